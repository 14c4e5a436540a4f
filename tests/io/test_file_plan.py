"""plan_files: greedy packing per writer, global HF numbering, determinism and errors."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workbench.errors import CheckpointError
from workbench.io.files.file_plan import FilePlan, FileSpec, file_name, plan_files


def names(plan: FilePlan) -> list[tuple[int, tuple[str, ...]]]:
    return [(f.writer, f.keys) for f in plan.files]


@pytest.mark.parametrize(
    ("sizes", "writers", "cap", "expected"),
    [
        # one writer, everything fits in one file
        ({"a": 1, "b": 2, "c": 3}, {"a": 0, "b": 0, "c": 0}, 10, [(0, ("a", "b", "c"))]),
        # greedy: a+b = 9 fits, c would overflow
        ({"a": 6, "b": 3, "c": 4}, {"a": 0, "b": 0, "c": 0}, 10, [(0, ("a", "b")), (0, ("c",))]),
        # exactly at the cap stays in one file
        ({"a": 5, "b": 5}, {"a": 0, "b": 0}, 10, [(0, ("a", "b"))]),
        # a key over the cap gets a file alone, and closes the file before and after it
        ({"a": 2, "big": 30, "c": 2}, {"a": 0, "big": 0, "c": 0}, 10, [(0, ("a",)), (0, ("big",)), (0, ("c",))]),
        # an oversized key first
        ({"big": 30, "c": 2}, {"big": 0, "c": 0}, 10, [(0, ("big",)), (0, ("c",))]),
        # two writers: writer 0's files come first; files never mix writers
        (
            {"a": 6, "b": 3, "c": 4, "d": 12, "e": 1},
            {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1},
            10,
            [(0, ("a", "b")), (0, ("c",)), (1, ("d",)), (1, ("e",))],
        ),
        # writers numbered in ascending rank order, whatever the key order says
        ({"x": 1, "y": 1}, {"x": 3, "y": 1}, 10, [(1, ("y",)), (3, ("x",))]),
        # interleaved key order: each writer keeps key_order's relative order
        ({"a": 1, "b": 1, "c": 1, "d": 1}, {"a": 0, "b": 1, "c": 0, "d": 1}, 10, [(0, ("a", "c")), (1, ("b", "d"))]),
        # zero-byte keys pack anywhere
        ({"a": 0, "b": 10, "c": 0}, {"a": 0, "b": 0, "c": 0}, 10, [(0, ("a", "b", "c"))]),
        # a rank with no keys gets no file (rank 1 absent)
        ({"a": 1, "b": 1}, {"a": 0, "b": 2}, 10, [(0, ("a",)), (2, ("b",))]),
    ],
)
def test_packing(sizes, writers, cap, expected) -> None:
    plan = plan_files(writers, sizes, list(sizes), max_shard_bytes=cap)
    assert names(plan) == expected, f"sizes={sizes} writers={writers} cap={cap}"
    assert plan.total_size == sum(sizes.values())
    for spec in plan.files:
        assert spec.nbytes == sum(sizes[k] for k in spec.keys)
        assert spec.nbytes <= cap or len(spec.keys) == 1


@pytest.mark.parametrize(
    ("num_files", "expected"),
    [
        (1, ["model-00001-of-00001.safetensors"]),  # one file is still numbered
        (
            3,
            [
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors",
            ],
        ),
    ],
)
def test_numbering(num_files: int, expected: list[str]) -> None:
    sizes = {f"k{i}": 10 for i in range(num_files)}
    plan = plan_files(dict.fromkeys(sizes, 0), sizes, list(sizes), max_shard_bytes=10)
    assert [f.name for f in plan.files] == expected
    assert plan.weight_map == {f"k{i}": expected[i] for i in range(num_files)}


def test_numbering_is_global_across_writers_and_prefix() -> None:
    sizes = {"a": 1, "b": 1, "c": 1}
    plan = plan_files({"a": 0, "b": 1, "c": 2}, sizes, ["a", "b", "c"], prefix="model-language")
    assert [f.name for f in plan.files] == [file_name("model-language", k, 3) for k in (1, 2, 3)]
    assert plan.files[1].name == "model-language-00002-of-00003.safetensors"


def test_files_of_and_writers() -> None:
    sizes = {"a": 6, "b": 6, "c": 6}
    plan = plan_files({"a": 0, "b": 2, "c": 2}, sizes, ["a", "b", "c"], max_shard_bytes=10)
    assert [f.keys for f in plan.files_of(2)] == [("b",), ("c",)]
    assert plan.files_of(1) == ()
    assert plan.writers == (0, 2)
    assert all(isinstance(f, FileSpec) for f in plan.files)


def test_empty_plan() -> None:
    plan = plan_files({}, {}, [])
    assert plan.files == () and plan.weight_map == {} and plan.total_size == 0


def test_str_and_repr() -> None:
    sizes = {"a": 6_000_000, "b": 3, "c": 4}
    plan = plan_files({"a": 0, "b": 0, "c": 1}, sizes, ["a", "b", "c"])
    assert str(plan).splitlines() == [
        "FilePlan: 2 file(s), 3 key(s), 6.0 MB, 2 writer(s)",
        "  model-00001-of-00002.safetensors  rank 0  2 key(s)  6.0 MB",
        "  model-00002-of-00002.safetensors  rank 1  1 key(s)  4 B",
    ]
    assert repr(plan) == "FilePlan(files=2, keys=3, total_size=6000007)"


def test_str_elides_long_plans() -> None:
    sizes = {f"k{i}": 1 for i in range(40)}
    plan = plan_files(dict.fromkeys(sizes, 0), sizes, list(sizes), max_shard_bytes=1)
    lines = str(plan).splitlines()
    assert len(lines) == 1 + 24 + 1 and "... 16 more files" in lines[13]


@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 50)), min_size=0, max_size=40),
    st.integers(1, 60),
    st.randoms(use_true_random=False),
)
def test_plan_properties(entries, cap, rng) -> None:
    """Every key in exactly one file, caps respected, numbering 1..N, and the same plan for any dict order."""
    sizes = {f"key{i}": size for i, (_, size) in enumerate(entries)}
    writers = {f"key{i}": rank for i, (rank, _) in enumerate(entries)}
    order = list(sizes)
    plan = plan_files(writers, sizes, order, max_shard_bytes=cap)
    assert sorted(k for f in plan.files for k in f.keys) == sorted(sizes)
    assert [f.writer for f in plan.files] == sorted(f.writer for f in plan.files)
    n = len(plan.files)
    assert [f.name for f in plan.files] == [file_name("model", k, n) for k in range(1, n + 1)]
    for spec in plan.files:
        assert spec.nbytes <= cap or len(spec.keys) == 1
        assert all(writers[k] == spec.writer for k in spec.keys)
        keys_of_writer = [k for k in order if writers[k] == spec.writer]
        assert list(spec.keys) == [k for k in keys_of_writer if k in spec.keys]
    # another rank builds its dicts in another order: the plan does not change
    shuffled = list(sizes)
    rng.shuffle(shuffled)
    again = plan_files({k: writers[k] for k in shuffled}, {k: sizes[k] for k in shuffled}, order, max_shard_bytes=cap)
    assert again == plan


@pytest.mark.parametrize(
    ("writers", "sizes", "order", "kwargs", "message"),
    [
        # a written key without a size
        ({"a": 0, "b": 0}, {"a": 1}, ["a", "b"], {}, "no size in key_bytes, e.g. ['b']"),
        # a key in key_order that nobody writes
        ({"a": 0}, {"a": 1, "ghost": 1}, ["a", "ghost"], {}, "key 'ghost' is in key_order but has no writer rank"),
        # a written key missing from key_order
        ({"a": 0, "b": 0}, {"a": 1, "b": 1}, ["a"], {}, "missing from key_order, e.g. ['b']"),
        # a key listed twice
        ({"a": 0}, {"a": 1}, ["a", "a"], {}, "key 'a' appears twice in key_order"),
        # bad caps
        ({"a": 0}, {"a": 1}, ["a"], {"max_shard_bytes": 0}, "max_shard_bytes must be positive, got 0"),
        ({"a": 0}, {"a": 1}, ["a"], {"max_shard_bytes": -5}, "max_shard_bytes must be positive, got -5"),
        # a negative size
        ({"a": 0}, {"a": -1}, ["a"], {}, "key_bytes must be >= 0, got 'a': -1"),
        # a prefix that is a path or hidden
        ({"a": 0}, {"a": 1}, ["a"], {"prefix": "sub/model"}, "file prefix must be a plain"),
        ({"a": 0}, {"a": 1}, ["a"], {"prefix": ""}, "file prefix must be a plain"),
    ],
)
def test_errors(writers, sizes, order, kwargs, message) -> None:
    with pytest.raises(CheckpointError) as info:
        plan_files(writers, sizes, order, **kwargs)
    assert message in str(info.value)


def test_default_cap_is_hf_5gb() -> None:
    sizes = {"a": 3 * 10**9, "b": 2 * 10**9, "c": 1}
    plan = plan_files(dict.fromkeys(sizes, 0), sizes, list(sizes))
    assert [f.keys for f in plan.files] == [("a", "b"), ("c",)]


def test_deterministic_across_calls() -> None:
    rng = random.Random(0)
    sizes = {f"k{i}": rng.randrange(1, 100) for i in range(200)}
    writers = {k: rng.randrange(8) for k in sizes}
    first, *others = (plan_files(writers, sizes, list(sizes), max_shard_bytes=150) for _ in range(3))
    assert all(plan == first for plan in others)
    assert len(first.files) > 8


@pytest.mark.parametrize(
    ("build", "message"),
    [
        # a file name twice
        (
            lambda: FilePlan((FileSpec("f", 0, ("a",), 1), FileSpec("f", 1, ("b",), 1)), {"a": "f", "b": "f"}, 2),
            "lists a file name twice: ['f', 'f']",
        ),
        # the weight map points outside the plan
        (lambda: FilePlan((FileSpec("f", 0, ("a",), 1),), {"a": "g"}, 1), "names files that are not in the plan"),
        # negative sizes and ranks
        (lambda: FileSpec("f", 0, ("a",), -1), "needs writer >= 0 and nbytes >= 0"),
        (lambda: FileSpec("f", -1, ("a",), 1), "needs writer >= 0 and nbytes >= 0"),
    ],
)
def test_value_type_invariants(build, message) -> None:
    with pytest.raises(CheckpointError) as info:
        build()
    assert message in str(info.value)


def test_file_spec_keys_become_a_tuple() -> None:
    assert FileSpec("f", 0, ["a", "b"], 2).keys == ("a", "b")  # type: ignore[arg-type]
