"""The node's side of the coordinator's REST API (bodies are the pydantic models in ravnest.spec)."""
from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import tenacity

from ravnest.client.api import Api, ApiError
from ravnest.failures import Failure
from ravnest.spec import (DataProof, FailureReport, HeartbeatRequest, HeartbeatResponse, JoinRequest, JoinResponse,
                          LinkReport, MetricsReport, Offered)
from ravnest.timeouts import COORDINATOR_RETRY_S




def _worth_retrying(error: BaseException) -> bool:
    """The coordinator is away (restarting, network) or failing: try again. A refusal (4xx) is final."""
    return isinstance(error, ApiError) and (error.status == 0 or error.status >= 500)


def must_arrive(call):
    """Retry a call whose result the job depends on (weights, state, failure reports) with exponential
    backoff and jitter for up to COORDINATOR_RETRY_S seconds: a coordinator restart mid-job loses
    nothing, and thousands of nodes that lost it at once do not come back in step."""
    return tenacity.retry(retry=tenacity.retry_if_exception(_worth_retrying), reraise=True,
                          wait=tenacity.wait_exponential(multiplier=0.2, max=10) + tenacity.wait_random(0, 1),
                          stop=tenacity.stop_after_delay(COORDINATOR_RETRY_S))(call)


class CoordinatorClient:
    """The node's calls, over the one REST client (ravnest/client/api.py)."""

    def __init__(self, url: str, *, join_token: str | None = None, timeout: float = 30.0,
                 verify: ssl.SSLContext | bool = True):
        # the join token also opens /v1/probe (bandwidth, measured before joining); node calls send their own
        self.api = Api(url, join_token, timeout, verify)  # (several URLs: one fails over to the next)
        self._join_token = join_token
        self.node_id: str | None = None
        self._node_token: str | None = None

    def _call(self, method: str, path: str, *, token: str | None, **kwargs) -> httpx.Response:
        return self.api.request(method, path, token=token, prefix=f"{method} {path}: ", **kwargs)

    def wait_until_reachable(self, timeout: float, stop: threading.Event) -> None:
        """Retry /healthz with backoff until it answers: nodes may start before the coordinator."""
        deadline = time.monotonic() + timeout
        delay = 0.2
        while True:
            try:
                self.api.request("GET", "/healthz")
                return
            except ApiError:
                if time.monotonic() + delay > deadline or stop.is_set():
                    raise
            stop.wait(delay)
            delay = min(delay * 2, 5.0)

    def check_join_token(self) -> None:
        """ApiError (401) at once if the coordinator refuses the join token: before the node spends seconds
        measuring itself, and before it makes an identity file for a node that was never admitted."""
        self._call("GET", "/v1/probe", token=self._join_token, params={"bytes": 1})

    @tenacity.retry(retry=tenacity.retry_if_exception(lambda e: isinstance(e, ApiError) and e.status == 409),
                    wait=tenacity.wait_fixed(2), stop=tenacity.stop_after_delay(60), reraise=True)
    def join(self, request: JoinRequest) -> JoinResponse:
        """Retried while the coordinator still sees a previous run of this node (same address) alive."""
        body = self._call("POST", "/v1/nodes", token=self._join_token, json=request.model_dump())
        joined = JoinResponse.model_validate(body.json())
        self.node_id, self._node_token = joined.node_id, joined.node_token
        return joined

    @property
    def me(self) -> str:
        """This node's id (it has joined)."""
        if self.node_id is None:
            raise RuntimeError("the node has not joined yet")
        return self.node_id

    def heartbeat(self, job_id: str | None, links: Sequence[LinkReport] = (), training_alone: bool = False,
                  proofs: Sequence[DataProof] = (), flops: float | None = None,
                  unreached: Sequence[str] = (), address: str | None = None) -> HeartbeatResponse:
        request = HeartbeatRequest(job_id=job_id, links=list(links), training_alone=training_alone,
                                   proofs=list(proofs), flops=flops, unreached=list(unreached), address=address)
        body = self._call("POST", f"/v1/nodes/{self.node_id}/heartbeat", token=self._node_token,
                          json=request.model_dump())
        return HeartbeatResponse.model_validate(body.json())

    def offer(self, offered: Offered) -> None:
        """What this node offers from now on (a volunteer changed its offers file)."""
        self._call("PUT", f"/v1/nodes/{self.node_id}/offers", token=self._node_token, json=offered.model_dump())

    def report_metrics(self, job_id: str, report: MetricsReport) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/metrics", token=self._node_token, json=report.model_dump())

    report_final_metrics = must_arrive(report_metrics)  # the job's result: retried, never dropped

    @must_arrive
    def report_failure(self, job_id: str, reason: str, recoverable: bool, still_training: bool = False,
                       failure: Failure | None = None) -> None:
        report = FailureReport(node_id=self.me, reason=reason[:2000], recoverable=recoverable,
                               still_training=still_training, failure=failure)
        self._call("POST", f"/v1/jobs/{job_id}/fail", token=self._node_token, json=report.model_dump())

    @must_arrive
    def upload_weights(self, job_id: str, cluster: int, stage: int, safetensors_file: Path) -> None:
        self._upload(f"/v1/jobs/{job_id}/weights", safetensors_file, {"cluster": cluster, "stage": stage})

    @must_arrive
    def upload_checkpoint(self, job_id: str, cluster: int, stage: int, generation: int, step: int, kind: str,
                          safetensors_file: Path) -> None:
        self._upload(f"/v1/jobs/{job_id}/checkpoint", safetensors_file,
                     {"cluster": cluster, "stage": stage, "generation": generation, "step": step, "kind": kind})

    def _upload(self, path: str, safetensors_file: Path, params: dict) -> None:
        """Streams the file: a stage's state is never held in memory a second time."""
        with safetensors_file.open("rb") as body:
            self._call("PUT", path, token=self._node_token, params=params, content=body,
                       headers={"Content-Type": "application/octet-stream",
                                "Content-Length": str(safetensors_file.stat().st_size)})

    @must_arrive
    def download_state(self, job_id: str, cluster: int, stage: int, target: Path) -> None:
        """The state a re-planned stage continues from, streamed to `target`."""
        self.api.download(f"/v1/jobs/{job_id}/state", target, token=self._node_token,
                          params={"cluster": cluster, "stage": stage})

    def leave(self) -> None:
        if self.node_id:
            self._call("DELETE", f"/v1/nodes/{self.node_id}", token=self._node_token)

    @property
    def http(self) -> httpx.Client:
        """The HTTP client of the coordinator in use."""
        return self.api.http

    def close(self) -> None:
        self.api.close()
