"""The files a volunteer offers to jobs, by name: their fingerprints, the proofs that this node holds
them, and offering again after the volunteer edits its offers file (SIGHUP), keeping the node's id.

Fingerprinting hashes a whole file, which takes seconds for a large one, so a new offer is made on
its own thread: heartbeats (and with them a running job's liveness) never wait for it.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import httpx

from node.client import CoordinatorClient
from node.progress import Progress
from ravnest.client.api import ApiError
from ravnest.data import proof, tokens
from ravnest.spec import DataChallenge, DataProof, Offered


class Offers:
    def __init__(self, files: dict[str, Path], progress: Progress,
                 reload: Callable[[], dict[str, Path]] | None = None):
        self.files = dict(files)  # name -> path; a running stage keeps the file it opened
        self.progress = progress
        self._reload = reload  # what the volunteer offers now (its offers file)
        self._again = threading.Event()

    def fingerprints(self) -> dict[str, str]:
        """Each offered name -> `<size>:<sha256>` of its file, logged for the volunteer to compare."""
        found = {name: proof.fingerprint(path) for name, path in self.files.items()}
        for name, fingerprint in sorted(found.items()):
            self.progress.log(f"offering {name}: {proof.size_of(fingerprint):,} bytes, "
                              f"sha256 {fingerprint.split(':')[1]}")
        return found

    def vocabularies(self, files: dict[str, Path] | None = None) -> dict[str, int]:
        """Each offered token file's vocabulary (the coordinator checks a job's model against it)."""
        found = {name: tokens.vocab_size_of(path) for name, path in (self.files if files is None else files).items()}
        return {name: size for name, size in found.items() if size is not None}

    def prove(self, challenge: DataChallenge) -> DataProof | None:
        """Answer a challenge to prove this node holds a file it offers (ravnest/data/proof.py)."""
        path = self.files.get(challenge.dataset)
        if path is None:
            return None
        asked = proof.Challenge(challenge.nonce, tuple((offset, length) for offset, length in challenge.ranges))
        try:
            return DataProof(dataset=challenge.dataset, nonce=challenge.nonce, answer=proof.answer(path, asked))
        except OSError as e:
            self.progress.log(f"cannot prove this node holds {challenge.dataset}: {e}")
            return None

    def keep_offering(self, client: CoordinatorClient, stop: threading.Event) -> None:
        """Offer again each time `reread` is asked, until `stop` (a daemon thread)."""
        def loop() -> None:
            while not stop.is_set():
                if self._again.wait(timeout=1.0):
                    self._again.clear()
                    self._offer(client)
        threading.Thread(target=loop, name="offers", daemon=True).start()

    def reread(self) -> None:
        """The volunteer changed its offers file (SIGHUP)."""
        self._again.set()

    def _offer(self, client: CoordinatorClient) -> None:
        try:
            offered = self._reload() if self._reload else self.files
            fingerprints = {name: proof.fingerprint(path) for name, path in offered.items()}
            client.offer(Offered(datasets=sorted(offered), fingerprints=fingerprints,
                                 vocab_sizes=self.vocabularies(offered)))
        except (OSError, ValueError, httpx.HTTPError, ApiError) as e:
            self.progress.log(f"offers unchanged: {e}")
            return
        self.files = dict(offered)
        self.progress.log(f"now offering {', '.join(sorted(offered)) or 'nothing'}")
