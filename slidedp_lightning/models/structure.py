"""Units from a model's structure: the block list, and the parameters before and after it.

Both built-in adapters (transformers models and user models with a block list) split a model the same way once
its block list is known: every child of a module on the path from the model to the block list that is not on that
path is a *side module* (containers without a forward of their own, ``ModuleDict``/``ModuleList``, are replaced by
their children). Side modules with parameters go to the embedding-side unit or the head-side unit:

- input embeddings (``nn.Embedding``) and rotary modules: embedding side;
- output projections (the model's output embeddings, a ``Linear`` tied to or shaped like an embedding) and final
  norms (``norm``, ``ln_f``, ``final_layer_norm``, ...): head side;
- anything else by registration order: registered before the path's next module, embedding side, else head side.

Streamed units are made resident around module calls, so a parameter held directly by a module on the path (its
own forward uses it outside any submodule call) cannot be streamed: the model is refused, naming that module.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from slidedp_lightning.models.adapter import UnitSpec, UnsupportedModelError

# attribute names transformers and nanoGPT/LitGPT-style models give the norm after the last block
FINAL_NORM_NAMES = frozenset({"norm", "ln_f", "norm_f", "final_norm", "final_layer_norm", "final_layernorm"})
CONTAINERS = (nn.ModuleDict, nn.ModuleList)  # never called: their children are
BlockContainer = nn.ModuleList | nn.ModuleDict  # a block list: a ModuleList, or a ModuleDict in insertion order


def numel(module: nn.Module) -> int:
    """Elements of ``module``'s distinct parameters."""
    return sum(p.numel() for p in module.parameters())


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def module_lists(model: nn.Module, *, dicts: bool = False) -> list[tuple[str, BlockContainer]]:
    """The ``ModuleList``s (and with ``dicts``, the ``ModuleDict``s of modules of one class) of ``model`` that hold
    parameters and lie inside no other one, by path."""
    out: list[tuple[str, BlockContainer]] = []
    for name, module in model.named_modules():
        # a ModuleDict of blocks holds modules of one class (nanoGPT's ``transformer`` dict holds the list and more)
        candidate = isinstance(module, nn.ModuleList) or (
            dicts and isinstance(module, nn.ModuleDict) and len({type(m) for m in module.children()}) == 1
        )
        if candidate and numel(module) and not any(name.startswith(p + ".") for p, _ in out):
            out.append((name, module))
    return out


def members(container: nn.Module) -> list[nn.Module]:
    """The blocks of a block list, in order (a ``ModuleDict``'s in insertion order)."""
    return list(container.children())


def describe_lists(model: nn.Module) -> str:
    """One line per candidate block list: path, length, block classes, share of the parameters."""
    total = max(numel(model), 1)
    rows = []
    for name, blocks in module_lists(model, dicts=True):
        classes = sorted({type(b).__name__ for b in members(blocks)})
        kind = "" if isinstance(blocks, nn.ModuleList) else f"{type(blocks).__name__}, "
        rows.append(
            f"'{name}' ({kind}{len(blocks)} x {'/'.join(classes)}, {100 * numel(blocks) / total:.0f}% of parameters)"
        )
    return "; ".join(rows) if rows else "none"


@dataclass(frozen=True)
class BlockPath:
    """The modules from the model (first) to its block list (last), and their paths."""

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]

    @property
    def blocks(self) -> nn.Module:
        return self.modules[-1]

    @property
    def path(self) -> str:
        return self.names[-1]


def block_path(model: nn.Module, path: str) -> BlockPath:
    """The modules from ``model`` down to the submodule at dotted ``path`` (which must exist)."""
    names, modules = [""], [model]
    for part in path.split("."):
        child = modules[-1]._modules.get(part)
        if child is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no submodule '{path}' (no '{part}' under "
                f"'{names[-1] or type(model).__name__}')."
            )
        names.append(join(names[-1], part))
        modules.append(child)
    return BlockPath(tuple(names), tuple(modules))


def _parts(name: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module`` itself, or the called parts of a container (recursively)."""
    if isinstance(module, CONTAINERS):
        for child_name, child in module.named_children():
            yield from _parts(join(name, child_name), child)
    else:
        yield name, module


def _refuse_direct_parameters(model: nn.Module, name: str, module: nn.Module) -> None:
    direct = [n for n, _ in module.named_parameters(recurse=False)]
    if direct or isinstance(module, (nn.ParameterList, nn.ParameterDict)):
        where = f"'{name}' ({type(module).__name__})" if name else f"the model itself ({type(module).__name__})"
        raise UnsupportedModelError(
            f"SlideDP cannot stream {type(model).__name__}: {where} holds parameter(s) {direct[:4]} directly, outside "
            "its blocks, embedding and head modules. SlideDP makes a unit's parameters resident around the calls of "
            "the modules that own them, and the forward of this module uses them outside any such call. Move them "
            "into a submodule of their own (called by the forward), or train the model with another strategy."
        )


def split_units(
    model: nn.Module,
    path: BlockPath,
    *,
    embed_side: tuple[nn.Module, ...] = (),
    head_side: tuple[nn.Module, ...] = (),
) -> list[UnitSpec]:
    """Embedding-side unit, one unit per block (``layers.<i>``), head-side unit (see the module docstring).

    ``embed_side`` / ``head_side``: modules known to belong to that side (e.g. transformers' input and output
    embeddings), whatever their registration order. Units without parameters are left out.
    """
    for name, module in zip(path.names[:-1], path.modules[:-1]):
        _refuse_direct_parameters(model, name, module)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    shapes = {tuple(m.weight.shape) for m in embeddings}
    tied = {id(m.weight) for m in embeddings}
    first, last = {id(m) for m in embed_side}, {id(m) for m in head_side}

    def side(name: str, module: nn.Module, registered_after: bool) -> str:
        if id(module) in last:
            return "head"
        if id(module) in first or isinstance(module, nn.Embedding) or "Rotary" in type(module).__name__:
            return "embed"
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and (id(weight) in tied or tuple(module.weight.shape) in shapes):
            return "head"
        if name.rpartition(".")[2] in FINAL_NORM_NAMES:
            return "head"
        return "head" if registered_after else "embed"

    levels: list[tuple[list[nn.Module], list[nn.Module]]] = []
    for prefix, node, nxt in zip(path.names[:-1], path.modules[:-1], path.modules[1:]):
        before: list[nn.Module] = []
        after: list[nn.Module] = []
        seen_next = False
        for child_name, child in node.named_children():
            if child is nxt:
                seen_next = True
                continue
            for name, part in _parts(join(prefix, child_name), child):
                if isinstance(part, (nn.ParameterList, nn.ParameterDict)):
                    _refuse_direct_parameters(model, name, part)
                if numel(part):
                    (after if side(name, part, seen_next) == "head" else before).append(part)
        levels.append((before, after))
    embed = [m for before, _ in levels for m in before]  # the outermost module's first
    head = [m for _, after in reversed(levels) for m in after]  # the innermost module's first

    specs: list[UnitSpec] = []
    seen: set[int] = set()
    if embed:
        specs.append(UnitSpec("embed", tuple(embed)))
        seen.update(id(p) for m in embed for p in m.parameters())
    blocks = members(path.blocks)
    if not blocks:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the block list '{path.path}' is empty: nothing to stream."
        )
    for i, block in enumerate(blocks):
        own = [p for p in block.parameters() if id(p) not in seen]
        if not own:
            raise UnsupportedModelError(
                f"SlideDP cannot stream {type(model).__name__}: block {i} of '{path.path}' ({type(block).__name__}) "
                "has no parameters of its own (none, or all shared with an earlier unit); SlideDP streams one unit "
                "of parameters per block."
            )
        seen.update(id(p) for p in own)
        specs.append(UnitSpec(f"layers.{i}", (block,), block=True))
    if head:
        specs.append(UnitSpec("head", tuple(head)))
    return specs


@dataclass(frozen=True)
class HiddenUse:
    """A module that holds parameters of the model outside the module tree (a plain object, a closure, a list
    attribute): its forward may read them although they are not its own, e.g. torchtune's ``TiedLinear`` head
    (``F.linear(x, tok_embeddings.weight)`` from an attribute of the decoder)."""

    holder: nn.Module
    where: str  # "output (TiedLinear) of TransformerDecoder"
    params: tuple[nn.Parameter, ...]


_MODULE_KEYS = frozenset(nn.Module().__dict__)  # nn.Module's own bookkeeping: registered children, hooks, flags
_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type, types.ModuleType, type(None))


def _held(value: object, holder: nn.Module, depth: int, seen: set[int]) -> Iterator[object]:
    """Modules and parameters reachable from ``value`` through containers, closures and plain objects' attributes
    (a few levels deep), never through ``holder`` itself (its bound methods)."""
    if id(value) in seen or depth > 4 or value is holder:
        return
    seen.add(id(value))
    if isinstance(value, (nn.Module, nn.Parameter)):
        yield value
        return
    if isinstance(value, _LEAVES):
        return
    items: Iterable[object]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    elif isinstance(value, functools.partial):
        items = (value.func, *value.args, *value.keywords.values())
    elif isinstance(value, types.MethodType):
        items = (value.__self__,)
    elif isinstance(value, types.FunctionType):
        items = [cell.cell_contents for cell in value.__closure__ or () if cell.cell_contents is not None]
    elif isinstance(getattr(value, "__dict__", None), dict):
        items = vars(value).values()
    else:
        return
    for item in items:
        yield from _held(item, holder, depth + 1, seen)


def hidden_uses(model: nn.Module) -> list[HiddenUse]:
    """Every module of ``model`` whose plain (unregistered) attributes reach parameters of ``model``."""
    params = {id(p) for p in model.parameters()}
    out = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in _MODULE_KEYS or isinstance(value, (nn.Module, nn.Parameter, torch.Tensor)):
                continue  # registered (or a tensor attribute, which is no parameter of the tree)
            found: dict[int, nn.Parameter] = {}
            for ref in _held(value, module, 0, set()):
                for p in ref.parameters() if isinstance(ref, nn.Module) else (ref,):
                    if id(p) in params:
                        found.setdefault(id(p), p)  # type: ignore[arg-type]  # a parameter of the model
            if found:
                where = f"{attr} ({type(value).__name__}) of {name or type(model).__name__}"
                out.append(HiddenUse(module, where, tuple(found.values())))
    return out
