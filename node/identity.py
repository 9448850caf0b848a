"""Who this node is across restarts: a secret in an identity file, by default in the node's data folder.

Like an IPFS or libp2p daemon's key, the file is made on first start and read at every start after, so
a restarted machine is the same node (same id, same row, same history) without a flag to remember. The
coordinator keeps only the secret's hash. One running process holds the file at a time (an advisory
lock): two processes with one identity would take each other's place, so the second one stops, saying
how to give it its own folder. `--ephemeral` uses no file: a new node at every start.
"""
from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path
from typing import IO, Callable

SECRET_HEX = 64


def default_data_dir() -> Path:
    """$RAVNEST_NODE_DIR, else ravnest/node under the user's data folder ($XDG_DATA_HOME or ~/.local/share)."""
    if os.environ.get("RAVNEST_NODE_DIR"):
        return Path(os.environ["RAVNEST_NODE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "ravnest" / "node"


def hold_identity(path: Path, log: Callable[[str], None]) -> tuple[str, IO]:
    """The secret in `path` (made, readable by its owner only, if missing) and the open file that holds its
    lock: keep that open for as long as the node runs."""
    path = path.expanduser()
    made = False
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
                file.write(secrets.token_hex(SECRET_HEX // 2) + "\n")
            made = True
        except FileExistsError:
            pass  # another process made it a moment ago: its lock decides below
    held = open(path)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        raise SystemExit(f"another ravnest-node on this machine is running as the node in {path}: give this "
                         "one its own folder (--data-dir DIR) or --ephemeral for a throwaway node") from None
    secret = held.read().strip()
    if len(secret) != SECRET_HEX or any(c not in "0123456789abcdef" for c in secret):
        held.close()
        raise SystemExit(f"{path} is not a ravnest node identity file ({SECRET_HEX} hex digits); "
                         "move it away to make a new one")
    if made:
        log(f"made this node's identity in {path} (mode 600, a secret): started again, the node keeps its id "
            "and history; each node on this machine needs its own --data-dir (--ephemeral: a throwaway node)")
    else:
        log(f"this is the node whose identity is in {path}")
    return secret, held
