"""The users' side of the coordinator's REST API: `Api` and the `ravnest` command."""
from ravnest.client.api import Api, ApiError

__all__ = ["Api", "ApiError"]
