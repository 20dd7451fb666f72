"""Training a train plan, by role:

* what a run takes and trains on: :mod:`.choices` (the schedule, optimizer and engine names,
  without torch), :mod:`.preflight` (the request checked before any process starts),
  :mod:`.data` and :mod:`.data_plan` (the batches), :mod:`.task` and :mod:`.loss` (the loss),
  :mod:`.checkpoint` (checkpoints and resume), :mod:`.paths`, :mod:`.vocab`;
* the local run and the torchrun rank: :mod:`.trainer` (``train_plan``, ``run_job``),
  :mod:`.torchrun_rank`, :mod:`.spawn` (starting ranks);
* one rank: :mod:`.rank_io` (what a rank is given and returns), :mod:`.rank` (the step loop),
  :mod:`.actions` (one action of the schedule), :mod:`.passes` (the split backward and
  recomputation), :mod:`.grads` (gradient sums and the norm), :mod:`.comm` (the wire),
  :mod:`.meters` (saved bytes, compute time), :mod:`.modules` (stage modules cut from the
  exported program), :mod:`.optim` (the optimizer and autocast every rank uses),
  :mod:`.lr_schedule`, :mod:`.torch_engine` (torch pipelining);
* after the run: :mod:`.results` (the figures against the plan's), :mod:`.reference` and
  :mod:`.reference_check` (single-process training and ``--check``), :mod:`.record`
  (``--record``), :mod:`.save` (the trained plan folder), :mod:`.overheads` and :mod:`.probe`
  (the engine's own costs).

The settings are :mod:`onnx_partition.settings.train`, resolved by
:mod:`onnx_partition.request.train`; the summary's text is :mod:`onnx_partition.cli.summary.train`.
"""

__all__ = ["actions", "checkpoint", "choices", "comm", "data", "data_plan", "grads", "loss",
           "lr_schedule", "meters", "modules", "optim", "overheads", "passes", "paths",
           "preflight", "probe", "rank", "rank_io", "record", "reference", "reference_check",
           "results", "save", "spawn", "task", "torch_engine", "torchrun_rank", "trainer",
           "vocab"]
