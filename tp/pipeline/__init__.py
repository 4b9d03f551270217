"""Pipeline parallelism: schedules as data (pure action-list generators and a simulator), the runner that executes
any of them on this rank's stages, and the B/W split of the weight gradients that zero-bubble schedules need."""
from . import schedules
from .runner import PipelineRunner, PipelineStage, ScheduleStats, model_chunks, unwrap
from .wgrad import DeferredWgrads, defer_wgrad

__all__ = ["schedules", "PipelineRunner", "PipelineStage", "ScheduleStats", "model_chunks", "unwrap", "DeferredWgrads",
           "defer_wgrad"]
