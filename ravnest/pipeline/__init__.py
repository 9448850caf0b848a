"""The zero-bubble asynchronous pipeline: stage runner, weight versioning, optimizer, local runners."""
from ravnest.pipeline.inbox import PipelineError
from ravnest.pipeline.local import (run_local_clusters, run_local_pipeline, run_single_process,
                                    run_threaded_clusters, run_threaded_pipeline)
from ravnest.pipeline.optim import StageOptimizer, build_optimizer, lr_factor
from ravnest.pipeline.stage import StageRunner

__all__ = ["PipelineError", "StageOptimizer", "StageRunner", "build_optimizer", "lr_factor",
           "run_local_clusters", "run_local_pipeline", "run_single_process", "run_threaded_clusters",
           "run_threaded_pipeline"]
