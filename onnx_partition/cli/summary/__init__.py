"""Every line the verbs print to a terminal, one module per verb: :mod:`.partition`,
:mod:`.simulate`, :mod:`.run`, :mod:`.train`. The HTML report is :mod:`onnx_partition.report`."""
