"""tests/conftest.py's fast paths for Triton's interpreter (_interpreter_fast_paths) against triton's own functions,
side by side on the kinds of arguments interpreted kernels pass and on the odd ones that must fall back: a triton
upgrade that changes one of the originals, or drops one, fails here rather than changing what a kernel test computes."""
import contextlib
from collections import namedtuple

import numpy as np
import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.language import core  # noqa: E402
from triton.language.semantic import TritonSemantic  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

import conftest  # noqa: E402

FAST_PATHS = {(interpreter, "_get_np_dtype"), (core, "_unwrap_if_constexpr"), (core, "_unwrap_shape"),
              (core.tensor, "__init__"), (core.block_type, "__init__"), (TritonSemantic, "broadcast_impl_value"),
              (TritonSemantic, "computation_type_impl"), (TritonSemantic, "binary_op_sanitize_overflow_impl"),
              (interpreter, "_patch_attr"), (TritonSemantic, "binary_op_type_checking_impl")}
SCALARS = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
           tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv, tl.float8e4b15]


@pytest.fixture
def paths():
    """(use): use("original") or use("fast") installs triton's functions or the fast paths for a with block; the
    process's state (fast paths installed unless INFER_TEST_SLOW_INTERPRETER=1) is restored afterwards."""
    if conftest.INTERPRETER_ORIGINALS:
        originals = dict(conftest.INTERPRETER_ORIGINALS)
    else:
        originals = {key: key[0].__dict__[key[1]] for key in conftest._interpreter_fast_paths()}
    current = {key: key[0].__dict__[key[1]] for key in originals}
    for (owner, name), original in originals.items():
        setattr(owner, name, original)
    fast = conftest._interpreter_fast_paths()

    @contextlib.contextmanager
    def use(which):
        for (owner, name), function in (fast if which == "fast" else originals).items():
            setattr(owner, name, function)
        try:
            yield
        finally:
            for (owner, name), function in originals.items():
                setattr(owner, name, function)
    try:
        yield use
    finally:
        for (owner, name), function in current.items():
            setattr(owner, name, function)


def state(x, depth=0):
    """What a caller can observe of x: its type and attributes, recursively (NumPy arrays by dtype, shape and bytes)."""
    assert depth < 12
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype, x.shape, x.tobytes())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [state(v, depth + 1) for v in x])
    if isinstance(x, dict):
        return ("dict", [(k, state(v, depth + 1)) for k, v in x.items()])
    if isinstance(x, (core.base_value, core.base_type, interpreter.TensorHandle)):
        return (type(x).__name__, [(k, state(v, depth + 1)) for k, v in vars(x).items()])
    return (type(x).__name__, x)


def outcome(call):
    try:
        return state(call())
    except Exception as e:  # the same error, and the same message
        return ("raised", type(e).__name__, str(e))


def side_by_side(use, call):
    with use("original"):
        expected = outcome(call)
    with use("fast"):
        got = outcome(call)
    assert got == expected
    return got


def test_every_fast_path_is_found_in_this_triton():
    """Each fast path finds the function it stands in for (a triton without one skips it silently in conftest)."""
    assert set(conftest._interpreter_fast_paths()) >= FAST_PATHS or conftest.INTERPRETER_ORIGINALS.keys() >= FAST_PATHS


def test_get_np_dtype_matches_triton(paths):
    types = SCALARS + [core.block_type(t, [2, 4]) for t in SCALARS] + [
        core.pointer_type(tl.float16), core.block_type(core.pointer_type(tl.int32), [8]), tl.void]
    for ty in types:
        side_by_side(paths, lambda: interpreter._get_np_dtype(ty))
    with paths("fast"):  # the same NumPy dtype objects
        assert all(interpreter._get_np_dtype(t) is np.dtype(np.uint16) for t in (tl.bfloat16, tl.uint16))
    assert side_by_side(paths, lambda: interpreter._get_np_dtype(tl.void))[0] == "raised"


def test_unwrap_if_constexpr_matches_triton(paths):
    pair = namedtuple("pair", "a b")
    handle = interpreter.TensorHandle(np.zeros(4, np.int32), tl.int32)
    values = [core.constexpr(3), core.constexpr(tl.float32), core.constexpr(core.constexpr(2)), 3, 2.5, True, None,
              "s", tl.float32, core.pointer_type(tl.int8), core.block_type(tl.int8, [4]),
              core.tensor(handle, core.block_type(tl.int32, [4])), [core.constexpr(1), 2, [core.constexpr(3)]],
              (core.constexpr(1), 2), pair(core.constexpr(1), 2), core.tuple([core.constexpr(1), 2]), np.int32(5)]
    for value in values:
        side_by_side(paths, lambda: core._unwrap_if_constexpr(value))


def test_unwrap_shape_matches_triton(paths):
    shapes = [[16, core.constexpr(32)], core.tuple([4, core.constexpr(8)]), [], [True, 2], (16, 32),
              core.constexpr([2, 4]), [core.constexpr(core.constexpr(2))], [2.0], [[2]]]
    for shape in shapes:
        side_by_side(paths, lambda: core._unwrap_shape(shape))


def test_block_type_matches_triton(paths):
    shapes = [[16, 32], [1], core.tuple([4, core.constexpr(8)]), [core.constexpr(2), 64], [], [3], [2.0], [True],
              [2 ** 21, 2 ** 20], (4, 8), core.constexpr([2, 4])]
    for element in (tl.float16, tl.int32, core.pointer_type(tl.bfloat16)):
        for shape in shapes:
            side_by_side(paths, lambda: core.block_type(element, shape))
    with paths("fast"):  # no shape tuple shared between two types
        a, b = core.block_type(tl.int8, [2, 4]), core.block_type(tl.int8, [2, 4])
    assert a == b and a.shape is not b.shape and a.shape.values is not b.shape.values
    assert a.shape.type is not b.shape.type and str(a) == "<['2', '4'], int8>" and a.numel == 8
    assert a.shape.type.types is not b.shape.type.types and a.shape.type == b.shape.type
    with paths("fast"):  # a type's list changed in place (the code generator does, to a tuple argument's) is its own
        a.shape.type.types[0] = b.shape.type.types[1] = core.constexpr_type(7)
        c = core.block_type(tl.int8, [2, 4])
    with paths("original"):
        assert state(c) == state(core.block_type(tl.int8, [2, 4]))


def test_tensor_matches_triton(paths):
    handle = interpreter.TensorHandle(np.arange(8, dtype=np.int32).reshape(2, 4), tl.int32)
    for ty in (core.block_type(tl.int32, [2, 4]), tl.int32, core.pointer_type(tl.float16),
               core.block_type(core.pointer_type(tl.float16), [1, 8])):
        got = side_by_side(paths, lambda: core.tensor(handle, ty))
        assert [k for k, _ in got[1]] == ["handle", "shape", "numel", "type", "dtype"]
    with paths("fast"):
        a, b = (core.tensor(handle, core.block_type(tl.int32, [2, 4])) for _ in range(2))
    assert a.shape is not b.shape and a.shape.values is not b.shape.values and a.shape[1].value == 4
    assert a.shape.type is not b.shape.type and a.shape.type.types is not b.shape.type.types
    with paths("fast"):  # a shape's list or type changed in place is its own: the next tensor's is triton's
        a.shape.values[0], a.shape.type.types[0] = core.constexpr(9), core.constexpr_type(9)
        c = core.tensor(handle, core.block_type(tl.int32, [2, 4]))
    with paths("original"):
        assert state(c) == state(core.tensor(handle, core.block_type(tl.int32, [2, 4])))


def tensor(data, ty):
    data = np.asarray(data, interpreter._get_np_dtype(ty))
    return core.tensor(interpreter.TensorHandle(data, ty), core.block_type(ty, list(data.shape)) if data.ndim else ty)


def test_broadcast_matches_triton(paths):
    semantic = interpreter.interpreter_semantic
    with paths("original"):
        pairs = [(np.ones((4, 8)), np.arange(32).reshape(4, 8)), (np.ones((1, 8)), np.ones((4, 8))),
                 (np.ones((4, 1)), np.ones((1, 8))), (np.ones(8), np.ones((2, 8))), (np.ones(8), np.ones(4)),
                 (np.array(3), np.ones((2, 4))), (np.array(3), np.array(4))]
        pairs = [(tensor(a, tl.int32), tensor(b, tl.float32)) for a, b in pairs]
    for lhs, rhs in pairs:
        side_by_side(paths, lambda: semantic.broadcast_impl_value(lhs, rhs))
    with paths("fast"):
        lhs, rhs = pairs[0]
        assert all(a is b for a, b in zip(semantic.broadcast_impl_value(lhs, rhs), (lhs, rhs)))


def test_binary_type_checking_matches_triton(paths):
    """The operands a binary op computes with, and its errors: the fast path's case (two tensors of one scalar type
    and shape, nothing promoted) answers the operands themselves, as triton does; the rest is triton's."""
    semantic = interpreter.interpreter_semantic
    with paths("original"):
        block = {t: tensor(np.arange(8).reshape(2, 4), t) for t in (tl.int32, tl.int8, tl.float16, tl.bfloat16,
                                                                     tl.float32, tl.uint32, tl.int1)}
        row = {t: tensor(np.arange(4), t) for t in (tl.int32, tl.float16)}
        scalar = {t: tensor(np.array(3), t) for t in (tl.int32, tl.float16, tl.float32)}
        pointer = tensor(np.arange(8, dtype=np.uint64).reshape(2, 4), core.pointer_type(tl.float16))
    pairs = [(block[t], block[t]) for t in block] + [(scalar[t], scalar[t]) for t in scalar] + [
        (block[tl.int32], block[tl.float32]), (block[tl.float16], block[tl.bfloat16]),
        (block[tl.int8], block[tl.int32]), (block[tl.int32], block[tl.uint32]), (block[tl.int32], row[tl.int32]), (row[tl.float16], block[tl.float16]),
        (block[tl.float16], scalar[tl.float16]), (scalar[tl.int32], block[tl.int32]), (block[tl.float32], 2.5),
        (3, block[tl.int8]), (pointer, block[tl.int32]), (block[tl.int32], pointer), (pointer, pointer),
        (pointer, block[tl.float32])]
    for lhs, rhs in pairs:
        for flags in ((False, False, True, False), (True, True, True, False), (False, False, True, True),
                      (False, False, False, False), (True, False, False, True)):
            got = side_by_side(paths, lambda: semantic.binary_op_type_checking_impl(lhs, rhs, *flags))
            if got[0] != "raised":
                for which in ("original", "fast"):  # the same objects where triton hands the operands back
                    with paths(which):
                        out = semantic.binary_op_type_checking_impl(lhs, rhs, *flags)
                    same = [o is v for o, v in zip(out, (lhs, rhs))]
                    if which == "original":
                        expected = same
                assert same == expected
    with paths("fast"):  # fp16 / fp16 computes in float32 (div_or_mod): cast, not handed back
        out = semantic.binary_op_type_checking_impl(block[tl.float16], block[tl.float16], False, False, True, True)
    assert all(o.dtype == tl.float32 for o in out)


def test_a_builtin_another_decorator_wraps_keeps_that_decorator(paths):
    """The fast _patch_attr calls a plain builtin's function itself; a function that only carries the builtin mark
    (another decorator over a builtin, functools.wraps copying the mark) is patched as triton patches it."""
    import functools
    import types
    calls = []

    @core.builtin
    def plain(x, _semantic=None):
        return ("plain", x, _semantic is interpreter.interpreter_semantic)

    @functools.wraps(plain)
    def wrapped(x, _semantic=None):
        calls.append(x)
        return plain(x + 1, _semantic=_semantic)
    results = []
    for which in ("original", "fast"):
        module = types.SimpleNamespace(plain=plain, wrapped=wrapped)
        scope = interpreter._LangPatchScope()
        with paths(which):
            interpreter._patch_attr(module, "plain", plain, interpreter.interpreter_builder, scope)
            interpreter._patch_attr(module, "wrapped", wrapped, interpreter.interpreter_builder, scope)
        results.append((module.plain(1), module.plain(2, _semantic=None), module.wrapped(5)))
        scope.restore()
        assert module.plain is plain and module.wrapped is wrapped
    assert results[0] == results[1] == (("plain", 1, True), ("plain", 2, True), ("plain", 6, True))
    assert calls == [5, 5]


def test_computation_type_matches_triton(paths):
    """The same type object (or error) for every pair of scalar types, scalar flags and div/mod."""
    semantic = interpreter.interpreter_semantic
    for a in SCALARS:
        for b in SCALARS:
            for flags in ((False, False, False), (False, False, True), (True, False, False), (False, True, True),
                          (True, True, True)):
                results = []
                for which in ("original", "fast", "fast"):  # the second fast call answers from the cache
                    with paths(which):
                        try:
                            results.append(semantic.computation_type_impl(a, flags[0], b, flags[1], flags[2]))
                        except TypeError as e:
                            results.append(str(e))
                assert results[1] is results[0] and results[2] is results[0] or results[0] == results[1] == results[2]


def test_sanitize_overflow_matches_triton(paths):
    """Without options.debug the sanitizer's device_assert checks nothing: the fast path skips computing its condition,
    and with debug on it is triton's own (it raises on an overflow)."""
    import dataclasses
    semantic, builder = interpreter.interpreter_semantic, interpreter.interpreter_builder
    options = builder.options
    with paths("original"):
        cases = [(tensor(np.array([2 ** 30, 5]), tl.int32), tensor(np.array([2 ** 30, 1]), tl.int32)),
                 (tensor(np.array([3, 4]), tl.int16), tensor(np.array([1, 2]), tl.int16)),
                 (tensor(np.array([2 ** 62]), tl.int64), tensor(np.array([2 ** 62]), tl.int64)),
                 (tensor(np.array([1]), tl.int32), tensor(np.array([1]), tl.int16)),
                 (tensor(np.array([1.5]), tl.float32), tensor(np.array([1.5]), tl.float32))]
    try:
        for debug in (False, True):
            builder.options = dataclasses.replace(options, debug=debug)
            results = [side_by_side(paths, lambda: semantic.binary_op_sanitize_overflow_impl(lhs, rhs, op))
                       for lhs, rhs in cases for op in (semantic.add, semantic.mul)]
            assert results[0] == (("raised", "AssertionError", "int32 overflow detected for operation add") if debug
                                  else ("NoneType", None))
            assert results[6][:2] == ("raised", "AssertionError") and results[2] == ("NoneType", None)
    finally:
        builder.options = options


@triton.jit
def _mixed_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr, M: tl.constexpr):
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, M)[None, :]
    x = tl.load(x_ptr + rows * M + cols)
    y = tl.load(y_ptr + cols)
    w = x.to(tl.int32) * 300000000 + 2000000000  # int32 overflow wraps (the interpreter only checks under debug)
    z = x.to(tl.float32) * y + ((x * 3 + 7) // 2 - (x >> 1) + 3) + tl.where(x > 2, 1.5, -2) + (w % 7 - w // 2 ** 28)
    acc = tl.sum(z, axis=1) / M
    tl.store(out_ptr + rows * M + cols, z + acc[:, None])


def test_a_kernel_computes_the_same_with_and_without_the_fast_paths(paths):
    torch = pytest.importorskip("torch")
    x = torch.arange(32, dtype=torch.int16).reshape(4, 8) - 11
    y = torch.linspace(-2, 2, 8, dtype=torch.float16)
    outs = []
    for which in ("original", "fast"):
        out = torch.empty(4, 8, dtype=torch.float32)
        with paths(which):
            _mixed_kernel[(1,)](x, y, out, N=4, M=8)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and outs[0].isfinite().all()
