import builtins
import os
from pathlib import Path

# Without a GPU, Triton kernels can only run in the interpreter; it must be chosen before anything imports triton.
# And torch.compile runs eagerly: infer compiles nothing, but GPTQModel's torch kernel (the oracle of the GPTQ tests,
# quant_helpers.gptqmodel_greedy) compiles its dequantization at every load, a C++ build per shape (minutes on a cold
# inductor cache) for the values an eager run gives.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# GPTQModel's progress bars (logbar) look for a notebook at every line they print, an import of IPython that fails
# each time when it is not installed: a few seconds of each quantizing test (session 75's profile).
os.environ.setdefault("LOGBAR_DISABLE_NOTEBOOK_DETECTION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _threads() -> int:
    """Torch's CPU threads in this test process: the cores shared among the pytest-xdist workers (scripts/test runs one
    a core), at most 2. Two workers of two threads each on two cores oversubscribe them: each worker's OpenMP threads
    spin while the other's run, which made CPU-bound test files about twice as slow (60 s against 30 s for
    test_engine_hf.py with session 59's families, on the 2-core CI machine)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, min(2, (os.cpu_count() or 1) // workers))


torch.set_num_threads(_threads())
if os.environ.get("PYTEST_XDIST_WORKER"):  # (and the infer processes a test starts: the same share of the cores)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads()))


def _interpret_device_calls_without_repatching() -> None:
    """Under TRITON_INTERPRET=1, triton's interpreter patches triton.language (inspect.getmembers over its modules)
    at every launch, and again at every call of a @triton.jit helper inside a kernel, per program: a third to two
    fifths of an interpreted kernel or engine test's time. A helper's call patches what its module sees
    (triton.language, triton.language.core) and leaves it so until the launch returns; here a helper whose modules
    this launch already patched skips it. Launches patch and restore as before. Test speed only: a triton whose interpreter lacks `_patch_lang` runs as it
    is, and INFER_TEST_SLOW_INTERPRETER=1 turns it off."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or hasattr(patch, "patched"):
        return
    patched: set = set()  # ids of the language modules the running launch has patched
    seen: dict = {}  # function -> the ids of the language modules it sees

    def langs(fn) -> set:
        if fn not in seen:
            import triton.language as tl
            seen[fn] = {id(v) for v in fn.__globals__.values() if isinstance(v, type(tl)) and v in (tl, tl.core)}
        return seen[fn]

    class Launch:  # the scope of a launch's patches: restored when the launch returns
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            patched.clear()
            self.scope.restore()

    def patch_lang(fn):
        mine = langs(fn)
        if patched and mine <= patched:  # a helper inside a launch whose patches cover its modules
            return None
        scope = patch(fn)
        if patched:  # a helper that sees a module the launch did not (the interpreter never restores these)
            patched.update(mine)
            return scope
        patched.update(mine)
        return Launch(scope)
    patch_lang.patched = patched
    interpreter._patch_lang = patch_lang


def _interpreter_fast_paths() -> dict:
    """Exact fast paths for the interpreter's hottest per-op helpers (each op of each program runs a dozen of them, in
    Python): {(owner, name): replacement}. Each handles the argument kinds interpreted kernels pass and hands anything
    else to triton's own function; each returns what the original returns (the same objects where it returns one of
    its arguments or a triton constant, fresh ones where triton builds fresh ones: nothing a caller could mutate is
    shared); tests/test_probes_session67_interp.py runs them side by side with the originals. Test speed only:
    INFER_TEST_SLOW_INTERPRETER=1 turns them off with the launch patch above, and a triton lacking one skips it.
    - interpreter._get_np_dtype (the original builds a 19-entry dict of triton types per call) remembers the NumPy
      dtype of a scalar type by name (triton's dtypes compare and hash by name; NumPy dtypes are immutable);
    - core._unwrap_if_constexpr (millions of calls) answers a constexpr or a plain value (int, float, tensor, type)
      without its four isinstance tests; core._unwrap_shape answers a list or triton tuple of ints and constexprs with
      one comprehension (the original unwraps the container, copies it, and unwraps each element again);
    - core.tensor.__init__ and core.block_type.__init__ (every op's result) build their shape tuples directly, with the
      element types triton's tuple() infers; a block type's numel, name and dimension types, and a tensor's numel and
      dimension constexprs, are remembered by its dimensions (fresh lists and tuple types each time: constexprs are
      values triton never changes, the lists are not);
    - interpreter._patch_attr (the stand-in each builtin gets at a launch) calls a plain builtin's function with the
      interpreter's semantic, as triton's stand-in does after rebuilding the keywords and the builtin's wrapper checks
      them (anything else carrying the builtin mark is patched by triton's own);
    - TritonSemantic.binary_op_type_checking_impl answers two tensors of one scalar type (no pointer) and one shape
      that computes in that type with the operands themselves, what triton's casts and broadcast hand back;
    - TritonSemantic.broadcast_impl_value returns two blocks of one shape as they are (what the original does, after
      comparing them dimension by dimension through triton's tuples); computation_type_impl remembers its answer for
      the same type objects and flags (a pure function of them; only the module's 19 scalar types reach it);
    - TritonSemantic.binary_op_sanitize_overflow_impl (every int add, sub and mul) checks its operands as triton does
      but skips computing the op again in int64 and comparing it with the type's range: that only feeds device_assert,
      which checks nothing unless the interpreter's options.debug is on (then triton's own runs).
    Measured on `pytest tests/test_probes_session61_famb.py -k "helium and (int4 or mixed_adapters_interpreted or
    gpu_code)"` (2 cores, shared): user CPU 28.6-29.4 s without these, 21.5-22.1 s with them; the interpreted part of
    the int4 test (cProfile) from 77 s to 33 s. The last four (session 75): an interpreted rms_norm program 1.13-1.42 ms
    -> 0.89-1.03 ms, and tests/test_probes_session58_rmoe.py with those three famb tests 83.7 -> 71.4 s of user CPU."""
    try:
        from triton.language import core
        from triton.runtime import interpreter
    except ImportError:
        return {}
    found = {}
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if get_np_dtype is not None and hasattr(core, "block_type"):
        np_dtypes: dict = {}  # a scalar type's name -> its NumPy dtype

        def _get_np_dtype(tt_dtype):
            scalar = tt_dtype.element_ty if type(tt_dtype) is core.block_type else tt_dtype
            if type(scalar) is not core.dtype:  # pointers, pointer blocks, anything else: as triton does
                return get_np_dtype(tt_dtype)
            key = scalar.name
            if key not in np_dtypes:
                np_dtypes[key] = get_np_dtype(scalar)
            return np_dtypes[key]
        found[(interpreter, "_get_np_dtype")] = _get_np_dtype
    unwrap = getattr(core, "_unwrap_if_constexpr", None)
    if unwrap is not None and all(hasattr(core, n) for n in ("constexpr", "tensor", "dtype", "block_type")):
        constexpr = core.constexpr
        plain = frozenset({int, float, bool, str, type(None), core.tensor, core.dtype, core.block_type,
                           getattr(core, "pointer_type", core.dtype)})

        def _unwrap_if_constexpr(o):
            kind = type(o)
            if kind is constexpr:
                return o.value
            if kind in plain:
                return o
            return unwrap(o)
        found[(core, "_unwrap_if_constexpr")] = _unwrap_if_constexpr
    unwrap_shape = getattr(core, "_unwrap_shape", None)
    if unwrap_shape is not None and hasattr(core, "constexpr") and isinstance(getattr(core, "tuple", None), type):
        constexpr, triton_tuple = core.constexpr, core.tuple

        def _unwrap_shape(shape):
            kind = type(shape)
            items = shape if kind is list else shape.values if kind is triton_tuple else None
            if items is None or not all(type(s) is int or type(s) is constexpr for s in items):
                return unwrap_shape(shape)
            return [s.value if type(s) is constexpr else s for s in items]
        found[(core, "_unwrap_shape")] = _unwrap_shape
    tensor_init = getattr(getattr(core, "tensor", None), "__init__", None)
    if tensor_init is not None and all(hasattr(core, n) for n in ("constexpr", "tuple", "tuple_type", "math")):
        constexpr, triton_tuple, tuple_type, prod, new = (core.constexpr, core.tuple, core.tuple_type, core.math.prod,
                                                          object.__new__)
        shapes: dict = {}  # a block's dimensions (ints) -> (numel, the dimensions' constexprs, their types)

        def __init__(self, handle, type):
            shape = type.shape if type.is_block() else ()
            dims = shape.values if builtins.type(shape) is triton_tuple else shape
            key = builtins.tuple(dims)
            known = shapes.get(key)
            if known is None:
                if not all(builtins.type(d) is int for d in key):  # (not a shape of ints: as triton builds it)
                    return tensor_init(self, handle, type)
                values = [constexpr(d) for d in key]
                known = shapes[key] = (constexpr(prod(key)), values, [v.type for v in values])
            self.handle = handle
            self.shape = new(triton_tuple)
            self.numel, self.type, self.dtype = known[0], type, type.scalar
            self.shape.values = list(known[1])
            self.shape.type = tuple_type(list(known[2]), None)
        __init__.__doc__ = tensor_init.__doc__
        found[(core.tensor, "__init__")] = __init__
    block_init = getattr(getattr(core, "block_type", None), "__init__", None)
    if (block_init is not None and (core, "_unwrap_shape") in found and (core.tensor, "__init__") in found
            and hasattr(core, "constexpr_type")
            and hasattr(core, "validate_block_shape")):
        constexpr_type, validate, fast_unwrap_shape = (core.constexpr_type, core.validate_block_shape,
                                                       found[(core, "_unwrap_shape")])
        blocks: dict = {}  # a block's dimensions (ints) -> (its numel, its shape tuple's str, the dimensions' types)

        def block_type__init__(self, element_ty, shape):
            kind = type(shape)
            dims = fast_unwrap_shape(shape) if kind is list or kind is triton_tuple else None
            if not dims or not all(type(d) is int for d in dims):  # an empty, odd or bad shape: triton's errors
                return block_init(self, element_ty, shape)
            self.element_ty = element_ty
            self.shape = new(triton_tuple)
            self.shape.values = dims
            key = tuple(dims)
            known = blocks.get(key)
            if known is None:
                self.shape.type = tuple_type([constexpr_type(d) for d in dims], None)
                known = blocks[key] = (validate(self.shape), str(self.shape), list(self.shape.type.types))
            else:
                self.shape.type = tuple_type(list(known[2]), None)
            self.numel, text = known[0], known[1]
            self.name = f'<{text}, {self.element_ty}>'
        found[(core.block_type, "__init__")] = block_type__init__
    patch_attr = getattr(interpreter, "_patch_attr", None)
    builtin = getattr(core, "builtin", None)
    if patch_attr is not None and builtin is not None and hasattr(interpreter, "interpreter_semantic"):
        wrapper_code = builtin(lambda _semantic=None: None).__code__  # (the code of core.builtin's wrapper)

        def _patch_attr(obj, name, member, builder, scope):
            function = getattr(member, "__wrapped__", None)
            if getattr(member, "__code__", None) is not wrapper_code or function is None:
                return patch_attr(obj, name, member, builder, scope)  # (anything but a plain builtin: as triton)

            def patched(*args, **kwargs):
                kwargs["_semantic"] = interpreter.interpreter_semantic
                return function(*args, **kwargs)
            scope.set_attr(obj, name, patched)
        found[(interpreter, "_patch_attr")] = _patch_attr
    try:
        from triton.language.semantic import TritonSemantic
    except ImportError:
        return found
    broadcast = getattr(TritonSemantic, "broadcast_impl_value", None)
    if broadcast is not None and hasattr(core, "block_type"):
        block_type = core.block_type

        def broadcast_impl_value(self, lhs, rhs):
            lhs_ty, rhs_ty = lhs.type, rhs.type
            if type(lhs_ty) is block_type and type(rhs_ty) is block_type and lhs_ty.shape.values == rhs_ty.shape.values:
                return lhs, rhs  # blocks of one shape: nothing to broadcast
            return broadcast(self, lhs, rhs)
        found[(TritonSemantic, "broadcast_impl_value")] = broadcast_impl_value
    type_checking = getattr(TritonSemantic, "binary_op_type_checking_impl", None)
    if type_checking is not None and all(hasattr(core, n) for n in ("tensor", "dtype", "block_type")):
        tensor, scalar_type, block_type = core.tensor, core.dtype, core.block_type

        def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                                         arithmetic_check=True, div_or_mod=False):
            if type(lhs) is tensor and type(rhs) is tensor and arithmetic_check and type(self) is TritonSemantic:
                scalar = lhs.dtype
                if scalar is rhs.dtype and type(scalar) is scalar_type:  # (one scalar type, no pointer)
                    lt, rt = lhs.type, rhs.type
                    if (lt is scalar and rt is scalar) or (type(lt) is block_type and type(rt) is block_type
                                                           and lt.shape.values == rt.shape.values):
                        if self.computation_type_impl(scalar, False, scalar, False, div_or_mod) is scalar:
                            return lhs, rhs  # nothing to cast, nothing to broadcast
            return type_checking(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        found[(TritonSemantic, "binary_op_type_checking_impl")] = binary_op_type_checking_impl
    computation_type = getattr(TritonSemantic, "computation_type_impl", None)
    if computation_type is not None and hasattr(core, "dtype"):
        scalar_type = core.dtype
        promoted: dict = {}  # (id(a_ty), a_is_scalar, id(b_ty), b_is_scalar, div_or_mod) -> (a_ty, b_ty, the type)

        def computation_type_impl(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
            if type(self) is not TritonSemantic or type(a_ty) is not scalar_type or type(b_ty) is not scalar_type:
                return computation_type(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
            key = (id(a_ty), a_is_scalar, id(b_ty), b_is_scalar, div_or_mod)
            known = promoted.get(key)
            if known is None or known[0] is not a_ty or known[1] is not b_ty:
                known = promoted[key] = (a_ty, b_ty, computation_type(self, a_ty, a_is_scalar, b_ty, b_is_scalar,
                                                                      div_or_mod))
            return known[2]
        found[(TritonSemantic, "computation_type_impl")] = computation_type_impl
    sanitize = getattr(TritonSemantic, "binary_op_sanitize_overflow_impl", None)
    if sanitize is not None and hasattr(TritonSemantic, "device_assert"):
        device_assert = TritonSemantic.device_assert

        def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op):
            options = self.builder.options
            if options.debug or type(self).device_assert is not device_assert:
                return sanitize(self, lhs, rhs, binary_op)
            if lhs.type.scalar.int_bitwidth >= 64 or not options.sanitize_overflow:
                return
            lhs_sca_ty, rhs_sca_ty = lhs.type.scalar, rhs.type.scalar
            if __debug__ and not lhs_sca_ty == rhs_sca_ty:  # triton's asserts (pytest rewrites those in conftest)
                raise AssertionError(f"expected matching operand types, got {lhs_sca_ty} and {rhs_sca_ty}")
            if __debug__ and not lhs_sca_ty.is_int():
                raise AssertionError(f"expected integer type, got {lhs_sca_ty}")
            # the rest computes the op again in int64 for a device_assert, which checks nothing without options.debug
        found[(TritonSemantic, "binary_op_sanitize_overflow_impl")] = binary_op_sanitize_overflow_impl
    return found


INTERPRETER_ORIGINALS: dict = {}  # (owner, name) -> triton's own function, for each fast path installed


def install_interpreter_fast_paths() -> None:
    for (owner, name), fast in _interpreter_fast_paths().items():
        INTERPRETER_ORIGINALS.setdefault((owner, name), owner.__dict__[name])
        setattr(owner, name, fast)


if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("INFER_TEST_SLOW_INTERPRETER"):
    _interpret_device_calls_without_repatching()
    install_interpreter_fast_paths()


def _one_tls_context_per_certificates() -> None:
    """The tests' one-off requests to the servers they start (httpx.post, httpx.get, an OpenAI client each) build an
    HTTP client each, and each client a TLS context with the CA bundle loaded, ~40 ms that no http:// request uses
    (1.5% of the suite's CPU, session 75's profile). ssl.create_default_context hands out one context per set of
    arguments instead (test speed only; every test speaks plain HTTP to 127.0.0.1)."""
    import ssl
    create = ssl.create_default_context
    if hasattr(create, "contexts"):
        return
    contexts: dict = {}

    def create_default_context(purpose=ssl.Purpose.SERVER_AUTH, *, cafile=None, capath=None, cadata=None):
        key = (purpose, cafile, capath, cadata)
        try:
            hash(key)
        except TypeError:  # (bytes-like cadata of a kind that does not hash: a context of its own)
            return create(purpose, cafile=cafile, capath=capath, cadata=cadata)
        if key not in contexts:
            contexts[key] = create(purpose, cafile=cafile, capath=capath, cadata=cadata)
        return contexts[key]
    create_default_context.contexts = contexts
    ssl.create_default_context = create_default_context


_one_tls_context_per_certificates()


@pytest.fixture(scope="session", autouse=True)
def _infer_cache(tmp_path_factory):
    """Built-in models are generated once per test session into a temporary cache (unless INFER_CACHE is set)."""
    if not os.environ.get("INFER_CACHE"):
        os.environ["INFER_CACHE"] = str(tmp_path_factory.mktemp("infer-cache"))
    yield



@pytest.fixture
def poisoned_outputs():
    """torch.empty returns NaN-filled tensors while deterministic mode is on (kernel tests use it: a row a kernel
    forgets to write fails the comparison)."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)


@pytest.fixture
def gen():
    """A generator with a fresh random seed every run (its initial_seed() names it on failure)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


_MISSING = object()


def defuser_originals() -> dict:
    """What GPTQModel's defuser replaces process-wide when it quantizes or loads a mixture of experts (transformers'
    sparse MoE blocks of every model type its registry replaces, Qwen3-MoE, Mixtral, Qwen2-MoE and GLM-4.5 among
    them, become per-expert ModuleLists, and its checkpoint conversion mapping renames their weights): {(module,
    attribute): the original}, taken before any test runs."""
    try:
        import importlib

        from defuser.model_registry import MODEL_CONFIG, PATCH
    except Exception:  # (GPTQModel's defuser absent: nothing patches transformers)
        return {}
    import transformers.conversion_mapping as conversion
    import transformers.modeling_utils as modeling
    found = {(m, "get_checkpoint_conversion_mapping"): getattr(m, "get_checkpoint_conversion_mapping", _MISSING)
             for m in (conversion, modeling)}
    for config in MODEL_CONFIG.values():
        for orig, _ in config.get(PATCH.REPLACE_MODULE, []):
            module, name = orig.rsplit(".", 1)
            try:
                m = importlib.import_module(module)
            except ImportError:  # (a model this transformers does not have: nothing to replace)
                continue
            if hasattr(m, name):
                found[(m, name)] = getattr(m, name)
    return found


def restore_originals(originals: dict) -> None:
    for (module, name), value in originals.items():
        if getattr(module, name, _MISSING) is not value:
            if value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)


@pytest.fixture(scope="session")
def _defuser_originals():
    return defuser_originals()


@pytest.fixture(autouse=True)
def _undo_defuser(_defuser_originals):
    """A test that quantizes or loads an MoE with GPTQModel in this process leaves transformers' MoE classes as they
    were for the next test (which may build transformers' Qwen3-MoE or Mixtral as the reference)."""
    yield
    restore_originals(_defuser_originals)

def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
