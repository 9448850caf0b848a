"""Where a re-planned job continues from.

When a job loses a node (or a stage fails while training, or a user resumes it), every surviving stage
hands in a snapshot of its state, and cluster 0 has written periodic checkpoints all along. Every
block is then taken from the freshest state anybody holds for it: the newest generation first (a
later run supersedes an earlier one), then the highest step. A lost stage's blocks thus come from the
stage holding the same segment in another cluster when there is one (their copies are kept close by
averaging), else from the last checkpoint.

Every stage of a pipeline must start from the same step (a micro-batch crosses all of them), so the
job continues from the smallest step among the chosen states; blocks taken from a later step are at
most that far ahead. The steps between that step and the furthest any stage had reached are trained
again and reported as `steps_redone`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredState:
    file: str  # relative to the job's directory
    generation: int
    blocks: tuple[int, int]
    step: int


def resume_point(stored: list[StoredState], num_blocks: int) -> dict[str, Any] | None:
    """{"step": s, "sources": [{"file", "blocks": [a, b], "step"}, ...]} covering blocks 0..num_blocks-1
    with contiguous ranges; None when some block has no stored state at all."""
    best: list[StoredState | None] = [None] * num_blocks
    for state in stored:
        for block in range(max(0, state.blocks[0]), min(num_blocks, state.blocks[1])):
            current = best[block]
            if current is None or (state.generation, state.step) > (current.generation, current.step):
                best[block] = state
    chosen = [state for state in best if state is not None]
    if len(chosen) < len(best):
        return None
    sources: list[dict[str, Any]] = []
    for block, state in enumerate(chosen):
        if sources and sources[-1]["file"] == state.file and sources[-1]["blocks"][1] == block:
            sources[-1]["blocks"][1] = block + 1
        else:
            sources.append({"file": state.file, "blocks": [block, block + 1], "step": state.step})
    return {"step": min(source["step"] for source in sources), "sources": sources}
