"""The TensorRT plugin registers: TensorRT's `tensorrt.plugin` reads the registered functions'
annotations as classes, so a module with postponed (string) annotations fails at build time,
before any engine exists. Without TensorRT (CPU machines), a stand-in `tensorrt.plugin` applies
the checks TensorRT's `register` and `impl` apply to a plugin's functions (the rules of its
`_parse_register_inputs`, `_parse_register_return` and `_validate_impl`, TensorRT 10.7 to 11.0);
where the real `tensorrt` imports, the plugin is registered with it."""

from __future__ import annotations

import importlib
import inspect
import shutil
import sys
import types
import typing

import pytest

from dspark_trt.plugins import sequential_draft as sd
from dspark_trt.plugins import sequential_draft_trt as registration

SERIALIZABLE = (int, float, bytes, bool, str)


class TensorDesc:  # what tensorrt.plugin.TensorDesc is to the checks: a class
    pass


class Tensor:
    pass


def check_register(function) -> tuple[list[str], dict]:
    """TensorRT's checks of a `@register` function: every parameter annotated, no defaults, tensor
    descriptors first (as classes: `issubclass`), then serialisable attributes; a tuple of
    TensorDesc returned."""
    tensors, attributes = [], {}
    for index, (name, param) in enumerate(inspect.signature(function).parameters.items()):
        assert param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY), name
        if param.annotation is inspect.Parameter.empty:
            raise ValueError(f"argument {name} has no type annotation")
        assert param.default is inspect.Parameter.empty, name
        if issubclass(param.annotation, TensorDesc):  # TypeError for a string annotation, as in TensorRT
            assert not attributes, "tensors and attributes interspersed"
            tensors.append(name)
        else:
            assert index > 0 and name not in ("outputs", "stream", "tactic")
            assert param.annotation in SERIALIZABLE, (name, param.annotation)
            attributes[name] = param.annotation
    returned = inspect.signature(function).return_annotation
    assert typing.get_origin(returned) is tuple
    assert all(issubclass(arg, TensorDesc) for arg in typing.get_args(returned))
    return tensors, attributes


def check_annotations(signature, tensors: list[str], attributes: dict, tensor_class: type, int_names: tuple) -> None:
    """The annotation rules `impl` and `aot_impl` share: where given, `outputs` is a tuple of
    `tensor_class`, each of `int_names` an int, a tensor one of the registered tensors, an attribute
    the registration's type."""
    for name, param in signature.parameters.items():
        annotation = param.annotation
        if annotation is inspect.Parameter.empty:
            continue
        if name == "outputs":
            assert typing.get_origin(annotation) is tuple
            assert all(issubclass(arg, tensor_class) for arg in typing.get_args(annotation))
        elif name in int_names:
            assert issubclass(annotation, int)
        elif issubclass(annotation, tensor_class):
            assert name in tensors
        else:
            assert attributes[name] == annotation, name


def check_impl(function, tensors: list[str], attributes: dict) -> None:
    """TensorRT's checks of an `@impl` function: the parameters are the tensors, the attributes,
    `outputs`, `stream`; nothing returned."""
    signature = inspect.signature(function)
    check_annotations(signature, tensors, attributes, Tensor, ("stream",))
    assert list(signature.parameters) == [*tensors, *attributes, "outputs", "stream"]
    assert signature.return_annotation in (inspect.Parameter.empty, None)


class KernelLaunchParams:
    grid_x = grid_y = grid_z = block_x = block_y = block_z = shared_mem = None


class SymExprs(list):
    pass


class SymIntExprs(SymExprs):
    def __init__(self, length: int):
        super().__init__([None] * length)


def SymInt32(value):  # noqa: N802  (TensorRT's name)
    return ("int32", value)


def check_aot_impl(function, tensors: list[str], attributes: dict) -> None:
    """TensorRT's checks of an `@aot_impl` function: tensors, attributes (agreeing with the
    registration), `outputs`, `tactic`; a 4-tuple of (str | bytes, str | bytes,
    KernelLaunchParams, a SymExprs) returned."""
    signature = inspect.signature(function)
    check_annotations(signature, tensors, attributes, TensorDesc, ("tactic",))
    names = list(signature.parameters)
    assert names[: len(tensors)] == tensors and names[-2:] == ["outputs", "tactic"]
    assert all(name in attributes for name in names[len(tensors) : -2])
    returned = signature.return_annotation
    assert typing.get_origin(returned) is tuple and len(typing.get_args(returned)) == 4
    for arg in typing.get_args(returned)[:2]:
        assert set(typing.get_args(arg)) == {str, bytes}
    assert issubclass(typing.get_args(returned)[2], KernelLaunchParams)
    assert issubclass(typing.get_args(returned)[3], SymExprs)


class ShapeExpr:
    """A constant dimension as TensorRT's shape expressions give it: `constant_value()` is a method."""

    is_constant = True

    def __init__(self, value: int):
        self.value = value

    def constant_value(self) -> int:
        return self.value

    def __eq__(self, other):
        return self.value == (other.value if isinstance(other, ShapeExpr) else other)


class Desc(TensorDesc):
    """A TensorDesc as an aot_impl sees one: its shape as (here constant) expressions."""

    def __init__(self, *shape):
        self.shape_expr, self.ndim = [ShapeExpr(d) for d in shape], len(shape)


@pytest.fixture
def stand_in_tensorrt(monkeypatch):
    """`tensorrt` and `tensorrt.plugin` modules whose `register`/`impl` apply the checks above."""
    registered = {}
    plugin = types.ModuleType("tensorrt.plugin")
    plugin.TensorDesc, plugin.Tensor = TensorDesc, Tensor

    def register(plugin_id):
        def decorate(function):
            registered[plugin_id] = check_register(function)
            return function
        return decorate

    def implementation(check, key: str):
        """`impl` / `aot_impl`: check the function against its registration, keep it under `id/key`."""
        def decorator(plugin_id):
            def decorate(function):
                check(function, *registered[plugin_id])
                registered[f"{plugin_id}/{key}"] = function
                return function
            return decorate
        return decorator

    plugin.register, plugin.impl, plugin.aot_impl = register, implementation(check_impl, "impl"), \
        implementation(check_aot_impl, "aot")
    plugin.KernelLaunchParams, plugin.SymExprs, plugin.SymIntExprs, plugin.SymInt32 = (
        KernelLaunchParams, SymExprs, SymIntExprs, SymInt32)
    tensorrt = types.ModuleType("tensorrt")
    tensorrt.plugin, tensorrt.int64 = plugin, "int64"
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", plugin)
    import dspark_trt.plugins.sequential_draft_trt as module

    monkeypatch.setattr(module, "_registered", None)
    return registered


def test_the_plugin_passes_tensorrts_registration_checks(stand_in_tensorrt):
    implementation = registration.register_tensorrt_plugin()
    tensors, attributes = stand_in_tensorrt[sd.PLUGIN_ID]
    assert tuple(tensors) == sd.INPUT_NAMES and tuple(attributes) == sd.ATTRIBUTES
    assert stand_in_tensorrt[sd.PLUGIN_ID + "/impl"]
    assert implementation == ("aot" if shutil.which("nvcc") else "jit")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed (the AOT kernel needs it)")
def test_the_ahead_of_time_implementation_launches_the_kernel_per_row(stand_in_tensorrt):
    from dspark_trt.plugins import sequential_draft_kernel as kernel

    assert registration.register_tensorrt_plugin() == "aot"
    aot = stand_in_tensorrt[sd.PLUGIN_ID + "/aot"]
    batch, block, vocab, hidden, rank, history, ngram, target_vocab = 3, 7, 8192, 576, 32, 40, 3, 49152
    descs = {name: Desc(1) for name in sd.INPUT_NAMES}
    descs.update(logits=Desc(batch, block, vocab), hidden=Desc(batch, block, hidden), w1=Desc(vocab + 1, rank),
                 history=Desc(batch, history), to_draft=Desc(target_vocab), copy_alpha=Desc(block, ngram))
    name, ptx, launch, extra = aot(*descs.values(), 1, 1, 3, 1, 0, outputs=(), tactic=0)
    assert name == b"sequential_draft" and b".visible .entry sequential_draft(" in ptx
    assert launch.grid_x == batch and (launch.block_x, launch.shared_mem) == kernel.launch_shape(rank)
    # the kernel's scalars, in its argument order (sequential_draft_kernel.cu)
    assert [value for _, value in extra] == [batch, block, vocab, hidden, rank, history, ngram, target_vocab,
                                              1, 1, 3, 1, 0]
    huge = {**descs, "w1": Desc(vocab + 1, 4096)}  # a head whose state would not fit in shared memory
    with pytest.raises(ValueError, match="shared memory"):
        aot(*huge.values(), 1, 1, 3, 1, 0, outputs=(), tactic=0)


def test_the_checks_catch_postponed_annotations(stand_in_tensorrt):
    """The failure TensorRT reported for this plugin, reproduced: string annotations."""
    namespace: dict = {}
    exec("from __future__ import annotations\n"
         "def describe(logits: TensorDesc, head: int) -> tuple[TensorDesc]: ...", {"TensorDesc": TensorDesc}, namespace)
    with pytest.raises(TypeError, match="must be a class"):
        check_register(namespace["describe"])


def test_the_registration_module_keeps_annotations_as_classes():
    import dspark_trt.plugins.sequential_draft_trt as module

    import __future__

    assert getattr(module, "annotations", None) is not __future__.annotations


def test_the_plugin_registers_with_the_real_tensorrt():
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (GPU machines)")
    importlib.import_module("tensorrt.plugin")
    registration.register_tensorrt_plugin()
    creators = [creator.name for creator in trt.get_plugin_registry().all_creators]
    assert sd.ONNX_OP_TYPE in creators
