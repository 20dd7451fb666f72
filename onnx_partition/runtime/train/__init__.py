"""Training a train plan: :mod:`.modules` (stage modules cut from the exported program),
:mod:`.task` and :mod:`.reference` (the loss, single-process reference training), :mod:`.rank`
and :mod:`.comm` (one rank running its action list), :mod:`.launch` (starting ranks),
:mod:`.trainer` (``train_plan`` and its figures), :mod:`.save` (the trained plan folder),
:mod:`.torch_engine` (torch pipelining), :mod:`.choices` (the schedule, optimizer and engine names,
without torch)."""

__all__ = ["choices", "comm", "launch", "modules", "rank", "reference", "save", "task",
           "torch_engine", "trainer"]
