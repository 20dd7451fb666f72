"""Every number a user gives: a bad one is one line on stderr and exit code 2, never a traceback,
and never taken for something else (a NaN bandwidth for a free link)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.cli import one_error, parser_that_never_runs_a_verb, verb_parsers
from support.graphs import CHAIN, save

from onnx_partition import values
from onnx_partition.cli.verbs import guarded, main
from onnx_partition.errors import PartitionError
from onnx_partition.values import OptionType, Rule


def numeric_options() -> list[tuple[str, str, Rule, int]]:
    """(verb, flag, rule, values it takes) of every numeric option of every verb."""
    found = []
    for verb, verb_parser in verb_parsers(parser_that_never_runs_a_verb()).items():
        for action in verb_parser._actions:
            if isinstance(action.type, OptionType):
                count = action.nargs if isinstance(action.nargs, int) else 1
                found.append((verb, action.type.flag, action.type.rule, count))
    return found


OPTIONS = numeric_options()


def test_every_numeric_option_is_covered():
    flags = {flag for _, flag, _, _ in OPTIONS}
    assert {"--bandwidth", "--latency", "--batch-size", "--microbatches", "--stages",
            "--inter-bandwidth", "--devices", "--machines", "--timeout", "--chunks"} <= flags


@st.composite
def bad_value(draw: st.DrawFn, rule: Rule) -> str:
    """Text that ``rule`` refuses: not a number, not finite, out of range, or (for an integer
    option) not whole."""
    choices = [
        st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "fast", "", "1e", "0x10",
                         "1,5", "1e999", " ", "½"]),
        st.floats(max_value=rule.low, exclude_max=not rule.low_open, allow_nan=False,
                  allow_infinity=False).map(repr),
        st.floats(min_value=rule.high, exclude_min=True, allow_nan=False).map(repr),
    ]
    if rule.kind is int:
        choices += [st.integers(max_value=int(rule.low) - 1).map(str),
                    st.integers(min_value=int(rule.high) + 1).map(str),
                    st.floats(allow_nan=False, allow_infinity=False)
                    .filter(lambda x: not x.is_integer()).map(repr)]
    return draw(st.one_of(choices))


# capsys is read (and so emptied) after every example
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_numbers_anywhere_on_the_command_line(capsys, data):
    verb, flag, rule, count = data.draw(st.sampled_from(OPTIONS))
    text = data.draw(bad_value(rule))
    # an option of several values (--betas B1 B2) gets the bad one first, then good ones
    fine = 0 if rule.low <= 0 <= rule.high and not rule.low_open else rule.high
    good = [str(rule.kind(fine))] * (count - 1)
    argv = [verb, f"{flag}={text}"] if count == 1 else [verb, flag, f"{text}", *good]
    if count > 1:
        assume(not text.startswith("-"))  # argparse reads "-x" there as an option
    parser = parser_that_never_runs_a_verb()  # main's parser and checks, with no verb to run
    code = guarded(lambda: parser.parse_args(argv).func(None))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {flag} must be "), lines[0]


def test_the_message_names_the_unit(capsys):
    line = one_error(capsys, ["partition", "m.onnx", "-s", "2", "--bandwidth", "nan", "-o", "x"],
                     "--bandwidth must be a finite number >= 0")
    assert line.endswith("GB/s, got 'nan'")
    one_error(capsys, ["partition", "m", "-o", "x", "--latency", "1e308"], "ms, got '1e308'")
    one_error(capsys, ["partition", "m", "-o", "x", "--batch-size", "0"],
              "--batch-size must be an integer from 1 to")
    one_error(capsys, ["run", "p", "--batch-size", "-3"], "--batch-size must be an integer")
    one_error(capsys, ["simulate", "p", "--microbatches", "100000000"],
              "--microbatches must be an integer from 1 to 4096")


@pytest.mark.parametrize(("item", "message"), [
    ("x=99999999999999999999,16", "--input-shape x dim 0 must be an integer from 1 to"),
    ("x=0,4", "--input-shape x dim 0 must be an integer from 1"),
    ("x=-2,4", "dim 0 must be an integer"),
    ("x=1.5,4", "expected NAME=D0,D1"),
    ("x=2147483647,2147483647", "elements is more than"),
])
def test_input_shapes(capsys, tmp_path, item, message):
    model = save(CHAIN, tmp_path / "m.onnx")
    one_error(capsys, ["partition", model, "-s", "2", "--input-shape", item, "-o",
                       tmp_path / "o"], message)


@pytest.mark.parametrize("memory", ["nan", "-5GB", "1e999GB", "1.2.3GB", "0", "lots"])
def test_device_memory(capsys, tmp_path, memory):
    model = save(CHAIN, tmp_path / "m.onnx")
    one_error(capsys, ["partition", model, "--batch-size", "2", "--devices", "2",
                       f"--device-memory={memory}", "-o", tmp_path / "o"], "--device-memory")


@pytest.mark.parametrize(("key", "value"), [("offset", "-5"), ("offset", "abc"),
                                            ("length", "-1"), ("length", "1e3")])
def test_external_data_offsets_and_lengths(capsys, tmp_path, key, value):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [2, 4])],
                              [helper.make_tensor_value_info("y", 1, [2, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True,
              location="m.data", size_threshold=0)
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    entries = model.graph.initializer[0].external_data
    found = [e for e in entries if e.key == key]
    entry = found[0] if found else entries.add()
    entry.key, entry.value = key, value
    onnx.save(model, str(tmp_path / "m.onnx"))
    one_error(capsys, ["partition", tmp_path / "m.onnx", "-s", "1", "-o", tmp_path / "o"],
              f"external data of 'w': {key} must be an integer")


def test_checked_numbers_keep_their_type():
    assert values.check("3", "n", Rule(int, 1, 5)) == 3
    assert values.check(2.0, "n", Rule(int, 1, 5)) == 2
    assert values.check("0.5", "x", Rule(float, 0, 1)) == 0.5
    for bad in (True, "2.5", 6, None, [1]):
        with pytest.raises(PartitionError, match="n must be an integer from 1 to 5"):
            values.check(bad, "n", Rule(int, 1, 5))
    with pytest.raises(PartitionError, match="> 0"):
        values.check(0, "t", Rule(float, 0, 1, low_open=True))
    from onnx_partition.cost.cluster import parse_bytes  # the one size reader, value-checked

    assert parse_bytes("80GB") == 80e9 and parse_bytes("1 KiB") == 1024


def test_a_nan_bandwidth_is_never_a_free_link(capsys, tmp_path):
    """The same option means the same with and without --devices (was: nan taken as free)."""
    model = save(CHAIN, tmp_path / "m.onnx")
    for extra in ([], ["--devices", "2"]):
        one_error(capsys, ["partition", model, "-s", "2", "--batch-size", "2", *extra,
                           "--bandwidth", "nan", "-o", tmp_path / "o"], "--bandwidth must be")
    assert not (tmp_path / "o").exists()
    assert main(["partition", str(model), "-s", "2", "--batch-size", "2", "--bandwidth", "0",
                 "-o", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "plan.json").read_text())["link"]["bandwidth_gbps"] == 0
