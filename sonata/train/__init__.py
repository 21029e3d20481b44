"""The training loop (trainer) and what it asks: the frozen plan (plan), the run's length
(schedule), one optimizer update (update), early stops (stops), the run's bookkeeping
(record), the summary (summary), scoring (evaluate), the micro-batch autotuner (autotune),
memory accounting and the guard (memory), the leak detector (leak), process groups
(distributed) and TensorBoard scalars (tensorboard_log). `Trainer` is re-exported here."""
from sonata.train.trainer import Trainer

__all__ = ["Trainer"]
