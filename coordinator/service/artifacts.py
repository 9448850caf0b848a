"""What nodes upload and fetch: final stage weights, checkpoints and snapshots of their state, the
state a re-planned stage continues from, the merged model (files: coordinator/files.py)."""
from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from ravnest.averaging.registry import NO_AVERAGING
from ravnest.models import ModelError, build_model
from ravnest.models.hf import hf_key, hf_texts
from ravnest.models.subspace import Subspace

from .. import files, jobs
from ..service_errors import Conflict, Forbidden, Implausible, InvalidRequest, NotFound
from ..jobs import JobState
from ..resume_point import StoredState, resume_point
from ..store import CheckpointRow, JobRow, StageRow, stages_of
from .core import HEADER_ALLOWANCE, OPTIMIZER_STATE_FACTOR, PERIODIC, Core, costs_of, initial_rms_of, state_shapes_of


class Artifacts:
    def __init__(self, core: Core) -> None:
        self.core = core

    def job_dir(self, job_id: str) -> Path:
        return self.core.settings.data_dir / "jobs" / job_id

    def upload_limit(self, job_id: str, authorization: str | None, cluster: int, stage: int, *,
                     checkpoint: bool = False) -> int:
        """Checks an upload may start (before its body is read); returns its size limit in bytes."""
        with self.core.store.session() as session:
            job, row = self.core.job_member(session, job_id, authorization)
            self._check_upload_target(job, row, cluster, stage, checkpoint=checkpoint)
            expected = sum(size for _, size in self._stage_shapes(job, row).values())
        copies = 1 + OPTIMIZER_STATE_FACTOR if checkpoint else 1
        sends_tokenizer = row.stage == 0 and not checkpoint and job.spec["dataset"]["name"] == "tokens"
        tokenizer = MAX_TOKENIZER if sends_tokenizer else 0  # (stage 0 sends its token file's with its weights)
        return min(self.core.settings.max_upload_bytes, copies * expected + HEADER_ALLOWANCE + tokenizer)

    def _check_upload_target(self, job: JobRow, row: StageRow, cluster: int, stage: int, *,
                             checkpoint: bool = False, generation: int | None = None) -> None:
        if (row.cluster, row.stage) != (cluster, stage):
            raise Forbidden(f"node {row.node_id} holds cluster {row.cluster} stage {row.stage}, "
                            f"not cluster {cluster} stage {stage}")
        if generation is not None and generation != job.generation:
            raise Conflict(f"job {job.id} was re-planned (generation {job.generation}); state of generation "
                           f"{generation} is no longer taken")
        accepted = jobs.ACTIVE | ({JobState.RECOVERING.value} if checkpoint else {JobState.COMPLETED.value})
        if job.state not in accepted:
            raise Conflict(f"job {job.id} is {job.state}; {'state' if checkpoint else 'weights'} not accepted")

    def _stage_shapes(self, job: JobRow, row: StageRow) -> files.Shapes:
        start, end = self.core.plan(job).clusters[row.cluster].stages[row.stage].blocks
        model = job.spec["model"]
        shapes = state_shapes_of(model["name"], json.dumps(model["config"], sort_keys=True))
        return {key: value for key, value in shapes.items() if start <= files.block_of(key) < end}

    def accept_weights(self, job_id: str, authorization: str | None, cluster: int, stage: int, upload: Path) -> None:
        """Validate an uploaded stage state dict (safetensors, no pickle), keep it, and finish the job
        once every stage of cluster 0 is in. Weights that cannot be the trained stage are refused
        (`Implausible`: the stage has not reported its last step, or a tensor grew implausibly)."""
        tensors, metadata = files.index(upload)
        scales = files.scan(upload, tensors)  # (outside the lock: it reads the whole file)
        tokenizer = _tokenizer(metadata) if stage == 0 else None
        with self.core.store.session() as session:  # the initial weights' scale, built outside the lock
            job, row = self.core.job_member(session, job_id, authorization)
            initial = self._initial_rms(job, row)
        with self.core.lock, self.core.store.session() as session:
            job, row = self.core.job_member(session, job_id, authorization)
            self._check_upload_target(job, row, cluster, stage)
            files.check_stage_tensors(tensors, self._stage_shapes(job, row), optimizer_state=False)
            self._check_plausible(job, row, scales, initial)
            folder = self.job_dir(job.id) / "weights"
            files.commit(upload, folder / f"c{cluster}-s{stage}.safetensors")
            if tokenizer is not None and cluster == 0:  # the model's tokenizer: cluster 0's, as its weights
                files.write_text(self.job_dir(job.id) / "tokenizer.json", tokenizer)
            row.weights_uploaded, row.updated_at = True, self.core.clock()
            cluster0 = [s for s in stages_of(session, job.id) if s.cluster == 0]
            if job.state != JobState.COMPLETED.value and all(s.weights_uploaded for s in cluster0):
                recorded = self.job_dir(job.id) / "tokenizer.json"
                files.merge([folder / f"c0-s{s}.safetensors" for s in range(len(cluster0))],
                            self.job_dir(job.id) / "model.safetensors",
                            {"job_id": job.id, "model": json.dumps(job.spec["model"]),
                             **({"tokenizer": recorded.read_text()} if recorded.is_file() else {})})
                job.final_metrics = dict(cluster0[-1].metrics)
                if job.state == JobState.PLACING.value:  # every node is done, so every node was told
                    jobs.transition(job, JobState.RUNNING,
                                    f"every node has its assignment; {self.core.plan(job).reason}", self.core.clock())
                jobs.transition(job, JobState.COMPLETED, "every stage of cluster 0 uploaded its weights",
                                self.core.clock())

    def _initial_rms(self, job: JobRow, row: StageRow) -> dict[str, float]:
        """The RMS of each of the stage's tensors at initialisation (built a block at a time, cached)."""
        start, end = self.core.plan(job).clusters[row.cluster].stages[row.stage].blocks
        model = job.spec["model"]
        config = json.dumps(model["config"], sort_keys=True)
        return {key: value for index in range(start, end)
                for key, value in initial_rms_of(model["name"], config, index).items()}

    def _check_plausible(self, job: JobRow, row: StageRow, scales: dict[str, float],
                         initial: dict[str, float]) -> None:
        steps = jobs.spec_of(job).training.steps
        if row.step < steps:
            raise Implausible(f"final weights before the last step: the stage reported step {row.step} of {steps}",
                              row.node_id)
        why = files.implausible(scales, initial, self.core.settings.weight_growth_bound)
        if why is not None:  # with peers, they may have grown through averaging or a neighbour's gradients
            plan = self.core.plan(job)
            averaged = len(plan.clusters) > 1 and jobs.spec_of(job).averaging.strategy != NO_AVERAGING
            alone = len(plan.clusters[row.cluster].stages) == 1 and not averaged
            raise Implausible(f"implausible weights: {why}", row.node_id, blame=alone)

    def accept_checkpoint(self, job_id: str, authorization: str | None, cluster: int, stage: int, generation: int,
                          step: int, kind: str, upload: Path) -> None:
        """Keep a stage's state (parameters, optimizer state) at `step`: a periodic checkpoint, or the
        snapshot a stage hands in when its job is re-planned. A complete set of periodic checkpoints at
        one step gets a manifest, and older periodic ones are deleted.

        Weights that grew past the plausible (files.implausible, as for final weights) are refused and not
        kept, so a re-plan resumes from the last plausible state rather than from poison. The uploader
        is not blamed: poison reaches honest stages through averaging, and it is the source's to answer
        for (the job goes on; only what this upload would have replaced stays)."""
        tensors, _ = files.index(upload)
        scales = files.scan(upload, tensors)  # no NaN (outside the lock: it reads the whole file)
        with self.core.lock, self.core.store.session() as session:
            job, row = self.core.job_member(session, job_id, authorization)
            self._check_upload_target(job, row, cluster, stage, checkpoint=True, generation=generation)
            files.check_stage_tensors(tensors, self._stage_shapes(job, row), optimizer_state=True)
            why = files.implausible(scales, self._initial_rms(job, row), self.core.settings.weight_growth_bound)
            if why is not None:
                raise InvalidRequest(f"this state is not kept, its weights are implausible: {why}; a re-plan "
                                     f"continues from the last plausible state")
            start, end = self.core.plan(job).clusters[cluster].stages[stage].blocks
            name = f"checkpoints/g{generation}-c{cluster}-s{stage}-{kind}-{step}.safetensors"
            files.commit(upload, self.job_dir(job.id) / name)
            session.merge(CheckpointRow(job_id=job.id, file=name, kind=kind, generation=generation,
                                        block_start=start, block_end=end, step=step, created_at=self.core.clock()))
            session.flush()
            if kind == PERIODIC:
                self._collect_checkpoint(session, job, generation, step)

    def _collect_checkpoint(self, session: Session, job: JobRow, generation: int, step: int) -> None:
        """Once the periodic checkpoints at (generation, step) cover every block, write the manifest
        (atomically: a reader sees the previous one or this one) and drop older periodic files."""
        rows = list(session.scalars(select(CheckpointRow).where(
            CheckpointRow.job_id == job.id, CheckpointRow.kind == PERIODIC,
            CheckpointRow.generation == generation, CheckpointRow.step == step).order_by(CheckpointRow.block_start)))
        num_blocks = len(costs_of(jobs.spec_of(job)))
        covered = 0
        for row in rows:
            if row.block_start == covered:
                covered = row.block_end
        if covered != num_blocks:
            return
        files.write_json(self.job_dir(job.id) / "checkpoints" / "manifest.json", {
            "job_id": job.id, "generation": generation, "step": step, "model": job.spec["model"],
            "files": [{"file": row.file, "blocks": [row.block_start, row.block_end]} for row in rows]})
        for made in (self.job_dir(job.id) / "checkpoints").glob("model-*"):  # an older checkpoint's model
            made.unlink(missing_ok=True)
        keep = {row.file for row in rows}
        for old in session.scalars(select(CheckpointRow).where(
                CheckpointRow.job_id == job.id, CheckpointRow.kind == PERIODIC,
                (CheckpointRow.generation < generation)
                | ((CheckpointRow.generation == generation) & (CheckpointRow.step < step)))):
            if old.file not in keep:
                (self.job_dir(job.id) / old.file).unlink(missing_ok=True)
                session.delete(old)

    def manifest(self, job_id: str) -> dict:
        try:
            return json.loads((self.job_dir(job_id) / "checkpoints" / "manifest.json").read_text())
        except (OSError, ValueError):
            return {}

    def resume_point(self, session: Session, job: JobRow) -> dict | None:
        """Where the job would continue from: the freshest stored state of every block (None: some
        block has none)."""
        stored = [StoredState(row.file, row.generation, (row.block_start, row.block_end), row.step)
                  for row in session.scalars(select(CheckpointRow).where(CheckpointRow.job_id == job.id))]
        return resume_point(stored, len(costs_of(jobs.spec_of(job))))

    def stage_state(self, job_id: str, authorization: str | None, cluster: int, stage: int) -> Path:
        """A temporary file (the caller removes it) with the state a re-planned stage continues from: its
        blocks, from the resume sources. Nothing is written before the caller is known to hold the stage."""
        with self.core.store.session() as session:
            job, row = self.core.job_member(session, job_id, authorization)
            if (row.cluster, row.stage) != (cluster, stage):
                raise Forbidden(f"node {row.node_id} holds cluster {row.cluster} stage {row.stage}")
            if not job.resume:
                raise NotFound(f"job {job_id} starts from fresh weights; there is no state to fetch")
            blocks = self.core.plan(job).clusters[cluster].stages[stage].blocks
            sources = job.resume["sources"]
        outgoing = self.job_dir(job_id) / "outgoing"
        outgoing.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=outgoing, suffix=".safetensors")
        os.close(handle)
        target = Path(name)
        try:
            files.assemble(self.job_dir(job_id), sources, blocks, target)
        except BaseException:
            target.unlink(missing_ok=True)
            raise
        return target

    def hf_folder(self, job_id: str, owner: str | None = None) -> Path:
        """The trained model as a Hugging Face folder in a zip (made once, then kept): config.json,
        model.safetensors under Llama's names (copied by offset: never in memory whole) and the
        tokenizer the job recorded (ravnest/models/hf.py)."""
        model = self.model_file(job_id, owner)
        target = model.with_name(f"{model.stem}-hf.zip")
        if target.is_file():
            return target
        tensors, metadata = files.index(model)
        try:
            ref = json.loads(metadata["model"])
            dtypes = {stored.dtype for stored in tensors.values()}
            texts = hf_texts(ref, "bfloat16" if dtypes == {"BF16"} else "float32", metadata.get("tokenizer"))
        except (ModelError, KeyError, ValueError) as e:
            raise InvalidRequest(f"job {job_id} has no Hugging Face form: {e}") from None
        spec = build_model("llama", ref["config"])
        layers = spec.config["num_hidden_layers"]
        weights = target.with_name(".model-hf.safetensors")
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".folded-") as scratch:
            folded = files.folded(model, Subspace.of(spec.config), Path(scratch))  # first: they win the merge
            files.merge([*folded, model], weights, {"format": "pt"}, rename=lambda key: hf_key(key, layers))
        handle, name = tempfile.mkstemp(dir=target.parent, prefix=".model-hf.zip.")
        os.close(handle)
        try:
            with zipfile.ZipFile(name, "w", zipfile.ZIP_STORED, allowZip64=True) as folder:
                for file, text in texts.items():
                    folder.writestr(file, text)
                folder.write(weights, "model.safetensors")  # (streamed from disk)
        finally:
            weights.unlink(missing_ok=True)
        files.commit(Path(name), target)
        return target

    def model_file(self, job_id: str, owner: str | None = None) -> Path:
        """The trained model of a completed job; of any other, the model of its last complete checkpoint
        (its metadata says the step), so a cancelled or failed job's training is not lost."""
        with self.core.store.session() as session:
            job = self.core.job(session, job_id, owner)
            state = job.state
        if state == JobState.COMPLETED.value:
            return self.job_dir(job_id) / "model.safetensors"
        manifest = self.manifest(job_id)
        if not manifest:
            raise Conflict(f"job {job_id} is {state} and has no checkpoint yet; the model is available once it is "
                           f"completed" + (" (`ravnest resume` continues it from its last checkpoint)"
                                           if state in jobs.STOPPED else ""))
        return self._checkpointed_model(job_id, manifest)

    def _checkpointed_model(self, job_id: str, manifest: dict) -> Path:
        """The parameters of a checkpoint's stage files as one model file (made once per checkpoint)."""
        step, generation = manifest["step"], manifest["generation"]
        target = self.job_dir(job_id) / "checkpoints" / f"model-g{generation}-step{step}.safetensors"
        if not target.is_file():
            files.merge([self.job_dir(job_id) / entry["file"] for entry in manifest["files"]], target,
                        {"job_id": job_id, "model": json.dumps(manifest["model"]), "step": str(step)},
                        keep=lambda key: files.OPTIMIZER_SEPARATOR not in key)  # (weights, not optimizer state)
        return target


MAX_TOKENIZER = 32 << 20  # bytes of a tokenizer.json stage 0 may send with its weights (Llama 3's: 9 MB)


def _tokenizer(metadata: dict[str, str]) -> str | None:
    """The tokenizer.json a first stage sent with its weights (its token file's), checked to be one."""
    text = metadata.get("tokenizer")
    if text is None:
        return None
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(text)
    except Exception as e:  # (tokenizers raises its own exception types)
        raise InvalidRequest(f"the tokenizer sent with the weights is not a tokenizer.json: {e}") from None
    return text
