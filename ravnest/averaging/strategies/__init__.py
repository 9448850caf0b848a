"""Averaging strategies, one module each, registered by name (see `ravnest.averaging.strategy`)."""
