"""The expression vocabulary: any box pushed down through any expression reads exactly the
bytes that the same torch operations would put in that box."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lazyload.expr import Cat, Chunk, Source, Stack, Transpose, apply_ops, box_shape, full_box


def evaluate(expr, tensors):
    """The expression computed with torch on whole tensors: the reference."""
    if isinstance(expr, Source):
        return tensors[expr.key]
    if isinstance(expr, Stack):
        return torch.stack([evaluate(p, tensors) for p in expr.parts], expr.dim)
    if isinstance(expr, Cat):
        return torch.cat([evaluate(p, tensors) for p in expr.parts], expr.dim)
    if isinstance(expr, Chunk):
        return torch.chunk(evaluate(expr.part, tensors), expr.count, expr.dim)[expr.index]
    if isinstance(expr, Transpose):
        return evaluate(expr.part, tensors).transpose(expr.dim0, expr.dim1)
    raise TypeError(expr)


@st.composite
def expressions(draw, shape, depth=0):
    """An expression of the given shape over fresh source tensors."""
    counter = draw(st.shared(st.just([0]), key="counter"))
    kinds = ["source"] if depth >= 3 else ["source", "stack", "cat", "chunk", "transpose"]
    kind = draw(st.sampled_from(kinds))
    if kind == "stack" and len(shape) >= 1:
        dim = draw(st.integers(0, len(shape) - 1))
        part_shape = shape[:dim] + shape[dim + 1:]
        return Stack(tuple(draw(expressions(part_shape, depth + 1)) for _ in range(shape[dim])), dim)
    if kind == "cat" and len(shape) >= 1 and shape[0] >= 2:
        dim = draw(st.integers(0, len(shape) - 1))
        if shape[dim] >= 2:
            cut = draw(st.integers(1, shape[dim] - 1))
            a = shape[:dim] + (cut,) + shape[dim + 1:]
            b = shape[:dim] + (shape[dim] - cut,) + shape[dim + 1:]
            return Cat((draw(expressions(a, depth + 1)), draw(expressions(b, depth + 1))), dim)
    if kind == "chunk" and len(shape) >= 1:
        dim = draw(st.integers(0, len(shape) - 1))
        count = draw(st.integers(1, 3))
        index = draw(st.integers(0, count - 1))
        whole = shape[:dim] + (shape[dim] * count,) + shape[dim + 1:]
        return Chunk(draw(expressions(whole, depth + 1)), dim, index, count)
    if kind == "transpose" and len(shape) >= 2:
        a, b = sorted(draw(st.lists(st.integers(0, len(shape) - 1), min_size=2, max_size=2, unique=True)))
        swapped = list(shape)
        swapped[a], swapped[b] = swapped[b], swapped[a]
        return Transpose(draw(expressions(tuple(swapped), depth + 1)), a, b)
    counter[0] += 1
    key = f"t{counter[0]}.{'x'.join(map(str, shape))}"
    return Source(key)


def source_shape(key: str) -> tuple[int, ...]:
    dims = key.split(".", 1)[1]
    return tuple(int(d) for d in dims.split("x")) if dims else ()


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    expr = draw(expressions(shape))
    box = tuple((lo, draw(st.integers(lo + 1, n))) for n in shape for lo in [draw(st.integers(0, n - 1))])
    return shape, expr, box


@settings(max_examples=300, deadline=None)
@given(cases())
def test_pushed_down_box_equals_the_torch_result(case):
    shape, expr, box = case
    generator = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(source_shape(k), generator=generator) for k in set(expr.keys())}
    assert expr.shape(source_shape) == shape
    expected = evaluate(expr, tensors)[tuple(slice(a, b) for a, b in box)]

    out = torch.full(box_shape(box), float("nan"))
    read = 0
    for piece in expr.pieces(box, source_shape):
        source = tensors[piece.key][tuple(slice(a, b) for a, b in piece.src_box)]
        local = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(piece.dst_box, box))
        out[local] = apply_ops(source, piece.ops)
        read += source.numel()
    assert torch.equal(out, expected)
    assert read == expected.numel()  # every element read once, nothing outside the box


def test_full_box_of_a_plain_source_is_one_piece():
    pieces = Source("w").pieces(full_box((4, 6)), lambda k: (4, 6))
    assert [(p.key, p.src_box, p.ops) for p in pieces] == [("w", ((0, 4), (0, 6)), ())]


def test_whole_reads_every_source_whole_and_computes_its_output():
    """The fallback node: whatever the box, each source is read whole, in its own coordinates
    (a source split over files as its parts); its shape comes from the operation on meta."""
    from lazyload.expr import Whole

    def interleave(tensors):  # an operation no box goes through
        (_, a), (_, b) = tensors
        return {"out": torch.stack([a, b], 1).reshape(-1, a.shape[1])}

    shapes = {"a": (3, 2), "b0": (2, 2), "b1": (1, 2)}
    split = Cat((Source("b0"), Source("b1")), 0)  # one source stored in two pieces
    expr = Whole(((0, Source("a")), (1, split)), "out", interleave, "interleave")
    assert expr.shape(shapes.__getitem__) == (6, 2)
    pieces = expr.pieces(((2, 4), (0, 1)), shapes.__getitem__)
    assert [(p.key, p.src_box, p.dst_box) for p in pieces] == [
        ("a", ((0, 3), (0, 2)), ((0, 3), (0, 2))), ("b0", ((0, 2), (0, 2)), ((0, 2), (0, 2))),
        ("b1", ((0, 1), (0, 2)), ((2, 3), (0, 2)))]
    assert [expr.position(k) for k in ("a", "b0", "b1")] == [0, 1, 1]
    a, b = torch.arange(6.).reshape(3, 2), -torch.arange(6.).reshape(3, 2)
    assert torch.equal(expr.compute([a, b]), interleave([(0, a), (1, b)])["out"])


def test_a_stack_remembers_its_shape_per_shape_of_and_still_pickles():
    import pickle

    stack = Stack((Source("a"), Source("b")), 0)
    assert stack.shape(lambda key: (3, 4)) == (2, 3, 4)
    assert stack.shape(lambda key: (5,)) == (2, 5)  # another index: asked again, not remembered

    class Index:  # as CheckpointIndex: shapes asked through a bound method, a new one each time
        asked = 0

        def shape_of(self, key):
            self.asked += 1
            return (6,)

    index = Index()
    assert stack.shape(index.shape_of) == (2, 6)
    asked = index.asked
    assert stack.shape(index.shape_of) == (2, 6) and index.asked == asked
    copy = pickle.loads(pickle.dumps(Cat((stack,), 0)))
    assert copy == Cat((stack,), 0) and copy.shape(lambda key: (7,)) == (2, 7)


def test_a_stack_of_alike_leaves_gives_each_part_its_own_pieces():
    """A stack of leaves of one layout (a layer's experts) pushes a box down through its first
    part only; each part still gets exactly the pieces it would give on its own, and one part of
    another layout (a single scale instead of blocks) sends the stack down part by part."""
    from lazyload.expr import Dequant

    shapes = {**{f"w{i}": (8, 6) for i in range(4)}, **{f"s{i}": (2, 2) for i in range(4)}, "one": (1, 1)}
    box = ((1, 3), (3, 8), (2, 5))
    for parts, alike in (([Dequant(f"w{i}", f"s{i}", (4, 4)) for i in range(4)], True),
                         ([Dequant(f"w{i}", f"s{i}", (4, 4)) for i in range(3)] + [Dequant("w3", "one", (4, 4))], False),
                         ([Source(f"w{i}") for i in range(4)], True)):
        stack = Stack(tuple(parts), 0)
        assert stack._measure(shapes.__getitem__)[1] == alike
        own = [p.moved(p.ops + (("unsqueeze", 0),), ((i, i + 1),) + p.dst_box)
               for i in (1, 2) for p in parts[i].pieces(box[1:], shapes.__getitem__)]
        assert stack.pieces(box, shapes.__getitem__) == own


def test_a_stack_of_alike_leaves_still_checks_them():
    """The first of alike parts answers for all of them, its checks included."""
    import pytest

    from lazyload.expr import Dequant

    parts = tuple(Dequant(f"w{i}", f"s{i}", (4, 4)) for i in range(3))
    wrong_scales = {**{f"w{i}": (8, 8) for i in range(3)}, **{f"s{i}": (3, 2) for i in range(3)}}
    with pytest.raises(ValueError, match="need"):
        Stack(parts, 0).shape(wrong_scales.__getitem__)
    mixed = {**{f"w{i}": (8, 8) for i in range(3)}, "w2": (8, 4), **{f"s{i}": (2, 2) for i in range(3)}, "s2": (2, 1)}
    with pytest.raises(ValueError, match="different shapes"):
        Stack(parts, 0).shape(mixed.__getitem__)
