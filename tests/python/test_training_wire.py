"""The FWB1 batch container (python/flywheel/_wire.py, docs/TRAINING_API.md "The binary
batch") and the datums built on it (flywheel.training.Datum / PreparedBatch): round trips
on the numpy and the array-module paths, and one test per malformed input.

Run: /usr/bin/python3 -m pytest tests/python/test_training_wire.py -q
"""

import array
import json
import struct

import pytest

from flywheel import _wire
from flywheel.training import Datum, PreparedBatch
from flywheel._wire import WireError

try:
    import numpy as np
except ImportError:  # the array-module path is tested either way
    np = None

needs_numpy = pytest.mark.skipif(np is None, reason="numpy is not importable")
PATHS = [False] + ([True] if np is not None else [])


def body_of(header, payload=b""):
    """A hand-made FWB1 body: magic, header length, the header's JSON, then payload."""
    text = json.dumps(header).encode()
    return b"FWB1" + struct.pack("<I", len(text)) + text + payload


def as_list(values):
    return [v.item() if hasattr(v, "item") else v for v in values]


# ---------------------------------------------------------------------------------------
# Layout, byte by byte


def test_layout_is_the_documented_one():
    body = _wire.encode({"lengths": [2], "seq": 7},
                        [("tokens", "i32", [1, -2]), ("logprobs", "f32", [0.5, -1.0]),
                         ("policy_versions", "u64", [3, 2**64 - 1])], use_numpy=False)
    assert body[:4] == b"FWB1"
    (header_bytes,) = struct.unpack_from("<I", body, 4)
    header = json.loads(body[8:8 + header_bytes])
    assert header == {"lengths": [2], "seq": 7, "arrays": [
        {"name": "tokens", "dtype": "i32", "count": 2},
        {"name": "logprobs", "dtype": "f32", "count": 2},
        {"name": "policy_versions", "dtype": "u64", "count": 2}]}
    payload = body[8 + header_bytes:]
    assert payload == (struct.pack("<2i", 1, -2) + struct.pack("<2f", 0.5, -1.0)
                       + struct.pack("<2Q", 3, 2**64 - 1))


@pytest.mark.parametrize("encode_numpy", PATHS)
@pytest.mark.parametrize("decode_numpy", PATHS)
def test_round_trip_both_paths(encode_numpy, decode_numpy):
    tokens = [0, 1, 2**31 - 1, -2**31, 5]
    floats = [0.0, -1.5, 3.25, 1e-30, -7.0]
    versions = [0, 1, 2**63, 2**64 - 1, 42]
    body = _wire.encode({"lengths": [3, 2]},
                        [("tokens", "i32", tokens), ("weights", "f32", floats),
                         ("policy_versions", "u64", versions), ("empty", "f32", [])],
                        use_numpy=encode_numpy)
    header, arrays = _wire.decode(body, use_numpy=decode_numpy)
    assert header["lengths"] == [3, 2]
    assert as_list(arrays["tokens"]) == tokens
    assert as_list(arrays["weights"]) == [struct.unpack("<f", struct.pack("<f", v))[0]
                                          for v in floats]
    assert as_list(arrays["policy_versions"]) == versions
    assert len(arrays["empty"]) == 0
    if decode_numpy:
        assert arrays["tokens"].dtype == np.int32 and arrays["weights"].dtype == np.float32
        assert arrays["policy_versions"].dtype == np.uint64
        arrays["tokens"][0] = 9  # writable copies, not views of the body
    else:
        assert isinstance(arrays["tokens"], array.array)


@needs_numpy
def test_numpy_inputs_of_other_dtypes_are_converted():
    body = _wire.encode({}, [("tokens", "i32", np.arange(4, dtype=np.int64)),
                             ("weights", "f32", np.linspace(0, 1, 4)),  # float64
                             ("versions", "u64", np.array([1, 2], dtype=np.uint8)),
                             ("grid", "f32", np.ones((2, 3), dtype=np.float32))])
    _, arrays = _wire.decode(body)
    assert arrays["tokens"].tolist() == [0, 1, 2, 3]
    assert arrays["weights"].tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1], abs=1e-7)
    assert arrays["versions"].tolist() == [1, 2]
    assert arrays["grid"].tolist() == [1.0] * 6  # flattened


def test_array_module_and_bytes_inputs():
    raw = struct.pack("<3i", 4, 5, 6)
    body = _wire.encode({}, [("a", "i32", array.array("i", [1, 2])), ("b", "i32", raw),
                             ("c", "f32", memoryview(struct.pack("<f", 2.5)))], use_numpy=False)
    _, arrays = _wire.decode(body, use_numpy=False)
    assert list(arrays["a"]) == [1, 2] and list(arrays["b"]) == [4, 5, 6]
    assert list(arrays["c"]) == [2.5]


def test_decode_accepts_bytearray_and_memoryview():
    body = _wire.encode({"lengths": [1]}, [("tokens", "i32", [3])])
    for view in (bytearray(body), memoryview(body)):
        assert as_list(_wire.decode(view)[1]["tokens"]) == [3]


# ---------------------------------------------------------------------------------------
# Encoding refuses what does not fit


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("dtype, values", [
    ("i32", [2**31]), ("i32", [-2**31 - 1]), ("i32", [1.5]), ("i32", ["7"]), ("i32", [None]),
    ("u64", [-1]), ("u64", [2**64]), ("f32", ["x"]), ("f32", [None])])
def test_encode_refuses_values_outside_the_dtype(use_numpy, dtype, values):
    with pytest.raises(WireError, match="array 'v'"):
        _wire.encode({}, [("v", dtype, values)], use_numpy=use_numpy)


@needs_numpy
@pytest.mark.parametrize("dtype, values", [
    ("i32", "np.array([2**31], dtype=np.int64)"), ("i32", "np.array([1.5])"),
    ("i32", "np.array([np.nan])"), ("u64", "np.array([-1], dtype=np.int64)"),
    ("i32", "np.array(['a'])"), ("f32", "np.array(['a'])")])
def test_encode_refuses_numpy_values_outside_the_dtype(dtype, values):
    with pytest.raises(WireError, match="array 'v'"):
        _wire.encode({}, [("v", dtype, eval(values))])


def test_encode_refuses_an_unknown_dtype():
    with pytest.raises(WireError, match="unknown dtype 'f64'"):
        _wire.encode({}, [("v", "f64", [1.0])])


def test_encode_refuses_a_duplicate_name():
    with pytest.raises(WireError, match="given twice"):
        _wire.encode({}, [("v", "i32", [1]), ("v", "i32", [2])])


def test_encode_refuses_bytes_that_are_not_whole_elements():
    with pytest.raises(WireError, match="whole number"):
        _wire.encode({}, [("v", "u64", b"\0" * 12)])


def test_encode_refuses_a_header_that_is_not_json():
    with pytest.raises(WireError, match="not JSON"):
        _wire.encode({"loss_value": float("nan")}, [])
    with pytest.raises(WireError, match="not JSON"):
        _wire.encode({"x": object()}, [])


def test_encode_refuses_a_header_with_arrays():
    with pytest.raises(WireError, match="'arrays'"):
        _wire.encode({"arrays": []}, [])


@needs_numpy
def test_use_numpy_true_without_numpy_is_an_error(monkeypatch):
    monkeypatch.setattr(_wire, "_np", None)
    with pytest.raises(WireError, match="numpy is not importable"):
        _wire.encode({}, [], use_numpy=True)
    body = _wire.encode({}, [("v", "i32", [1, 2])])  # auto: the array-module path
    assert list(_wire.decode(body)[1]["v"]) == [1, 2]


# ---------------------------------------------------------------------------------------
# Decoding: one test per corruption


GOOD = _wire.encode({"lengths": [2]}, [("tokens", "i32", [1, 2]), ("logprobs", "f32", [0, 0])])


@pytest.mark.parametrize("use_numpy", PATHS)
def test_decode_good_body(use_numpy):
    header, arrays = _wire.decode(GOOD, use_numpy=use_numpy)
    assert header["lengths"] == [2] and as_list(arrays["tokens"]) == [1, 2]


@pytest.mark.parametrize("length", [0, 3, 7])
def test_body_shorter_than_its_prefix(length):
    with pytest.raises(WireError, match="shorter than its 8-byte prefix"):
        _wire.decode(GOOD[:length])


def test_bad_magic():
    with pytest.raises(WireError, match="bad magic b'FWB2'"):
        _wire.decode(b"FWB2" + GOOD[4:])


def test_header_bytes_past_the_end():
    with pytest.raises(WireError, match="header_bytes 4096 at byte 4 runs past"):
        _wire.decode(b"FWB1" + struct.pack("<I", 4096) + GOOD[8:])


def test_header_not_utf8():
    with pytest.raises(WireError, match="not UTF-8 JSON"):
        _wire.decode(b"FWB1" + struct.pack("<I", 2) + b"\xff\xfe")


def test_header_not_json():
    with pytest.raises(WireError, match="not UTF-8 JSON"):
        _wire.decode(b"FWB1" + struct.pack("<I", 5) + b"{nope")


def test_header_not_an_object():
    with pytest.raises(WireError, match="JSON list, not an object"):
        _wire.decode(body_of([1, 2]))


def test_header_without_arrays():
    with pytest.raises(WireError, match="no 'arrays' list"):
        _wire.decode(body_of({"lengths": [1]}))
    with pytest.raises(WireError, match="no 'arrays' list"):
        _wire.decode(body_of({"arrays": {"name": "tokens"}}))


@pytest.mark.parametrize("lengths", [[0], [-1], [1.5], ["2"], [True], 3, None])
def test_bad_lengths(lengths):
    with pytest.raises(WireError, match="'lengths' must be a list of integers >= 1"):
        _wire.decode(body_of({"lengths": lengths, "arrays": []}))


@pytest.mark.parametrize("entry, message", [
    ("tokens", "arrays\\[0\\] is not an object"),
    ({"dtype": "i32", "count": 0}, "'name' must be a non-empty string"),
    ({"name": "", "dtype": "i32", "count": 0}, "'name' must be a non-empty string"),
    ({"name": 5, "dtype": "i32", "count": 0}, "'name' must be a non-empty string"),
    ({"name": "t", "dtype": "f64", "count": 0}, "unknown dtype 'f64'"),
    ({"name": "t", "count": 0}, "unknown dtype None"),
    ({"name": "t", "dtype": "i32"}, "'count' must be an integer >= 0"),
    ({"name": "t", "dtype": "i32", "count": -1}, "'count' must be an integer >= 0"),
    ({"name": "t", "dtype": "i32", "count": 1.0}, "'count' must be an integer >= 0"),
    ({"name": "t", "dtype": "i32", "count": True}, "'count' must be an integer >= 0"),
])
def test_bad_array_entry(entry, message):
    with pytest.raises(WireError, match=message):
        _wire.decode(body_of({"arrays": [entry]}))


def test_array_listed_twice():
    entry = {"name": "t", "dtype": "i32", "count": 1}
    with pytest.raises(WireError, match="'t' listed twice"):
        _wire.decode(body_of({"arrays": [entry, entry]}, b"\0" * 8))


@pytest.mark.parametrize("use_numpy", PATHS)
def test_array_runs_past_the_body(use_numpy):
    with pytest.raises(WireError, match="'logprobs' \\(2 x f32\\) at byte .* runs past"):
        _wire.decode(GOOD[:-1], use_numpy=use_numpy)


def test_count_too_large_for_the_body():
    header = {"arrays": [{"name": "t", "dtype": "u64", "count": 2}]}
    with pytest.raises(WireError, match="'t' \\(2 x u64\\) at byte"):
        _wire.decode(body_of(header, b"\0" * 12))


def test_trailing_bytes():
    with pytest.raises(WireError, match="3 bytes after the last array"):
        _wire.decode(GOOD + b"abc")


def test_wire_error_is_a_value_error_and_a_flywheel_error():
    import flywheel
    assert issubclass(WireError, ValueError) and issubclass(WireError, flywheel.FlywheelError)


# ---------------------------------------------------------------------------------------
# split / concat


def test_split_per_token_and_inferred():
    assert [list(p) for p in _wire.split("l", [1, 2, 3, 4, 5], [2, 3])] == [[1, 2], [3, 4, 5]]
    pieces = _wire.split("routing", list(range(10)), [2, 3], per_token=None)
    assert [list(p) for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]


@pytest.mark.parametrize("flat, per_token, message", [
    ([1, 2, 3, 4], 1, "4 values, but the lengths need 5 x 1"),
    ([1] * 11, None, "not a multiple"),
    ([1] * 6, 2, "6 values, but the lengths need 5 x 2")])
def test_split_refuses_counts_that_do_not_add_up(flat, per_token, message):
    with pytest.raises(WireError, match=message):
        _wire.split("l", flat, [2, 3], per_token=per_token)


# ---------------------------------------------------------------------------------------
# Datums


def test_from_prompt_completion_shifts_and_weights():
    d = Datum.from_prompt_completion([13, 3, 1, 12], [1, 3, 14], logprobs=[-0.1, -0.2, -0.3],
                                     advantage=0.5, policy_versions=[4, 4, 5])
    assert as_list(d.tokens) == [13, 3, 1, 12, 1, 3]
    assert as_list(d.target_tokens) == [3, 1, 12, 1, 3, 14]
    assert as_list(d.weights) == [0, 0, 0, 1, 1, 1]
    assert as_list(d.logprobs) == pytest.approx([0, 0, 0, -0.1, -0.2, -0.3])
    assert as_list(d.advantages) == [0.5] * 6
    assert as_list(d.policy_versions) == [4, 4, 4, 4, 4, 5]
    assert d.ref_logprobs is None and d.routing is None and len(d) == 6


def test_from_prompt_completion_of_a_one_token_prompt():
    d = Datum.from_prompt_completion([13], [7])
    assert as_list(d.tokens) == [13] and as_list(d.target_tokens) == [7]
    assert as_list(d.weights) == [1] and d.logprobs is None and d.advantages is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[], completion_ids=[1]), "non-empty prompt"),
    (dict(prompt_ids=[1], completion_ids=[]), "non-empty prompt"),
    (dict(prompt_ids=[1], completion_ids=[2, 3], logprobs=[0.0]), "1 logprobs for 2"),
    (dict(prompt_ids=[1], completion_ids=[2], policy_versions=[1, 2]), "2 policy_versions"),
    (dict(prompt_ids=[1, 2], completion_ids=[3], routing=[1, 2, 3]), "does not split")])
def test_from_prompt_completion_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Datum.from_prompt_completion(**kwargs)


def test_prepared_batch_round_trips_every_field():
    datums = [
        Datum.from_prompt_completion([13, 1], [2, 14], logprobs=[-1, -2], advantage=1.0,
                                     policy_versions=[3, 3], routing=list(range(12))),
        Datum.from_prompt_completion([13], [5, 6, 14], logprobs=[-1, -2, -3], advantage=-1.0,
                                     policy_versions=[3, 4, 4], routing=list(range(12, 24))),
    ]
    for d in datums:
        d.ref_logprobs = [-0.5] * len(d)
    batch = PreparedBatch(datums)
    body = batch.encode({"seq": 3, "loss": "ppo", "loss_config": {"tis_cap": 2.0}})
    header, arrays = _wire.decode(body)
    assert header["lengths"] == [3, 3] and header["seq"] == 3 and header["loss"] == "ppo"
    assert [a["name"] for a in header["arrays"]] == [
        "tokens", "target_tokens", "weights", "logprobs", "advantages", "ref_logprobs",
        "policy_versions", "routing"]
    assert as_list(arrays["tokens"]) == [13, 1, 2, 13, 5, 6]
    assert as_list(arrays["target_tokens"]) == [1, 2, 14, 5, 6, 14]
    assert as_list(arrays["weights"]) == [0, 1, 1, 1, 1, 1]
    assert as_list(arrays["routing"]) == list(range(24))


def test_prepared_batch_leaves_out_fields_no_datum_has():
    header, _ = _wire.decode(PreparedBatch([Datum([1, 2], [2, 3])]).encode({}))
    assert [a["name"] for a in header["arrays"]] == ["tokens", "target_tokens"]


@pytest.mark.parametrize("datums, error, message", [
    ([], ValueError, "at least one datum"),
    ([Datum([], [])], ValueError, "tokens is empty"),
    ([Datum([1], [1, 2])], ValueError, "target_tokens has 2 values, tokens 1"),
    ([Datum([1], [2], weights=[1, 1])], ValueError, "weights has 2 values"),
    ([Datum([1], [2], logprobs=[0.0]), Datum([1], [2])], ValueError,
     "logprobs is given for some datums but not datum 1"),
    ([Datum([1, 2], [2, 3], routing=[1, 2, 3])], ValueError, "not a multiple"),
    ([Datum([1], [2], routing=[1, 2]), Datum([1], [2], routing=[1, 2, 3])], ValueError,
     "routing has 3 indices per position, datum 0 has 2"),
    ([Datum([2**31], [0])], WireError, "values do not fit|outside i32"),
    ([(1, 2)], TypeError, "not a Datum"),
])
def test_prepared_batch_refuses(datums, error, message):
    with pytest.raises(error, match=message):
        PreparedBatch(datums)


def test_prepared_batch_refuses_a_single_datum():
    with pytest.raises(TypeError, match="list of Datum"):
        PreparedBatch(Datum([1], [2]))
