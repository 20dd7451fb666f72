"""Training a train plan: :mod:`.modules` (stage modules cut from the exported program),
:mod:`.task` and :mod:`.reference` (the loss, single-process reference training), :mod:`.optim`
(the optimizer and autocast every rank uses), :mod:`.rank` and :mod:`.comm` (one rank running its
action list), :mod:`.passes` (the split backward and recomputation), :mod:`.spawn` (starting
ranks),
:mod:`.trainer` (``train_plan`` and its figures), :mod:`.save` (the trained plan folder),
:mod:`.lr_schedule` (learning-rate schedules), :mod:`.checkpoint` (checkpoints and resume),
:mod:`.torch_engine` (torch pipelining), :mod:`.choices` (the schedule, optimizer and engine names,
without torch)."""

__all__ = ["checkpoint", "choices", "comm", "lr_schedule", "modules", "optim", "passes", "rank",
           "reference", "save", "spawn", "task", "torch_engine", "trainer"]
