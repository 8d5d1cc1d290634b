"""Mapping: every model tensor as an expression over checkpoint tensors.

Each checkpoint key is tried, in order, as: the exact model name; the name with the
model's base prefix added or removed; the user's `key_map`; the conversion rules (renames,
then at most one gathering rule): transformers' own published mapping for its models
(`hf_rules`), lazyload's built-in table (`rules`) otherwise. Checkpoint keys that reach no model tensor are
unexpected; model tensors that no key reaches are missing. A pre-quantized weight stands
for its dequantization (`quant.formats`): its scale siblings are part of it, never keys of
their own. Only names and shapes are used: nothing here reads a tensor byte.
"""
from __future__ import annotations

import difflib
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Mapping as MappingT, Sequence

import torch
from torch import nn

from .errors import ArgumentError, DtypeError, MappingError, MissingKeysError, ShapeMismatchError, UnexpectedKeysError
from .expr import Cat, Chunk, Expr, ShapeOf, Stack, Transpose, Whole
from .gcpause import no_cycle_collection
from .index import CheckpointIndex, natural_key
from .quant.formats import Quantization, detect
from .quant.fp8_modules import fp8_quantizer, scale_conversions
from .rules import BUILTIN_RULES, CatOp, ChunkOp, StackOp, TransposeOp, rules_from
from .targets import TargetSpec

KeyMap = MappingT[str, str] | Callable[[str], str]
KEY_MAP_HELP = ("key_map maps checkpoint key -> model key: {regex: replacement} (re.sub, first matching "
                "pattern wins) or a callable")


@dataclass(frozen=True)
class Mapping:
    exprs: dict[str, Expr]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
    unused_key_map: tuple[str, ...] = ()  # key_map patterns that match no checkpoint key
    # checkpoint keys of buffers the model computes itself (see build_mapping): not loaded
    ignored_buffer_keys: list[str] = field(default_factory=list)
    # checkpoint keys of modules a pipeline stage left out (see other_stages): not loaded
    other_stages: list[str] = field(default_factory=list)
    # model tensors no key reaches that the model expects to be missing (its
    # `_keys_to_ignore_on_load_missing`, e.g. Marian's sinusoidal positions): no error, but
    # given the model's own init, as from_pretrained gives them
    expected_missing: list[str] = field(default_factory=list)



def check_key_map(key_map: KeyMap | None, keys: Sequence[str]) -> tuple[str, ...]:
    """Refuse a key_map lazyload cannot apply (not a dict or callable, a pattern that is not
    a regex, a replacement that does not fit its pattern); return the patterns that match
    no checkpoint key (a key_map written model key -> checkpoint key matches nothing)."""
    if key_map is None or callable(key_map):
        return ()
    if not isinstance(key_map, MappingT):
        raise ArgumentError(f"key_map={key_map!r} is neither a dict nor a callable; {KEY_MAP_HELP}.")
    unused = []
    for pattern, replacement in key_map.items():
        if not isinstance(pattern, str) or not isinstance(replacement, str):
            raise ArgumentError(f"key_map entry {pattern!r}: {replacement!r} is not str -> str; {KEY_MAP_HELP}.")
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ArgumentError(f"key_map pattern {pattern!r} is not a valid regular expression ({exc}); "
                                f"{KEY_MAP_HELP}.") from exc
        hit = next((k for k in keys if regex.search(k)), None)
        if hit is None:
            unused.append(pattern)
            continue
        try:
            regex.sub(replacement, hit, count=1)
        except (re.error, IndexError) as exc:
            raise ArgumentError(f"key_map replacement {replacement!r} does not fit its pattern {pattern!r} "
                                f"({exc}); {KEY_MAP_HELP}.") from exc
    return tuple(unused)


def _apply_key_map(key: str, key_map: KeyMap | None) -> str:
    if key_map is None:
        return key
    if callable(key_map):
        return key_map(key)
    for pattern, replacement in key_map.items():
        key, n = re.subn(pattern, replacement, key, count=1)
        if n:
            break
    return key


class _Resolver:
    """Finds the model name a checkpoint key stands for."""

    def __init__(self, targets: Collection[str], aliases: MappingT[str, str], base_prefix: str,
                 key_map: KeyMap | None, renames: Sequence, converts: Sequence):
        self.known = set(targets) | set(aliases)
        self.base_prefix = base_prefix
        self.key_map = key_map
        self.renames = renames
        self.converts = converts

    def with_prefix(self, key: str) -> str | None:
        if key in self.known:
            return key
        p = self.base_prefix
        if p:
            if key.startswith(p + ".") and key[len(p) + 1:] in self.known:
                return key[len(p) + 1:]
            if f"{p}.{key}" in self.known:
                return f"{p}.{key}"
        return None

    def resolve(self, key: str) -> tuple[str, Any, int] | None:
        """(model name, converting rule or None, source pattern index) or None."""
        name = self.with_prefix(key)
        if name is not None:
            return name, None, 0
        mapped = _apply_key_map(key, self.key_map)
        if mapped != key:
            name = self.with_prefix(mapped)
            if name is not None:
                return name, None, 0
        renamed = mapped
        for rename in self.renames:
            renamed = rename.apply(renamed)
        for convert in self.converts:
            hit = convert.match(renamed)
            if hit is not None:
                converted, source_index = hit
                full = self._converted_name(converted, convert)
                return (full, convert, source_index) if full is not None else None
        name = self.with_prefix(renamed) if renamed != mapped else None  # an unchanged name was tried above
        return (name, None, 0) if name is not None else None

    def _converted_name(self, renamed: str, convert: Any) -> str | None:
        """The rule's first target's model name (a rule with several targets, e.g. a
        chunked source, is found through whichever of its targets the model has)."""
        first = convert.targets[0]
        for target in convert.targets:
            name = self.with_prefix(renamed.replace(first, target, 1))
            if name is not None:
                return name.replace(target, first, 1)
        return None


VOCABULARY = (StackOp, CatOp, ChunkOp, TransposeOp)


def _build_whole(convert: Any, by_source: dict[int, list[str]], first_name: str, leaf: Callable[[str], Expr],
                 shape_of: ShapeOf) -> dict[str, Expr]:
    """A conversion with an operation outside lazyload's vocabulary, as `expr.Whole` nodes:
    transformers' own conversion (`convert.run`) on the whole sources, one node per output
    (model name -> expr); the outputs are found by running it on meta tensors."""
    keyed = sorted(((key, i) for i, keys in by_source.items() for key in keys), key=lambda ki: natural_key(ki[0]))
    sources = tuple((i, leaf(key)) for key, i in keyed)  # the order from_pretrained collects them in
    run = lambda tensors: convert.run(first_name, tensors)  # noqa: E731
    probe = Whole(sources, "", run, repr(convert))
    try:
        outputs = run([(i, torch.empty(s.shape(shape_of), device="meta")) for i, s in sources])
    except Exception as exc:  # transformers' operation, on shapes it does not take
        raise MappingError(f"{first_name}: the conversion {convert!r} fails on the checkpoint's tensors "
                           f"{probe} ({type(exc).__name__}: {exc}); check that the model config matches the "
                           "checkpoint.") from exc
    return {name: replace(probe, output=name) for name in outputs}


def _build_converted(convert: Any, by_source: dict[int, list[str]], first_name: str,
                     leaf: Callable[[str], Expr], shape_of: ShapeOf) -> dict[str, Expr]:
    """Apply a gathering rule's ops to its checkpoint keys; returns model name -> expr. A rule
    with an operation outside the vocabulary runs whole (`_build_whole`) when it can."""
    if not all(isinstance(op, VOCABULARY) for op in convert.ops) and hasattr(convert, "run"):
        return _build_whole(convert, by_source, first_name, leaf, shape_of)
    values: dict[int, list[Expr]] = {i: [leaf(k) for k in keys]  # keys come in natural order
                                     for i, keys in sorted(by_source.items())}
    outputs: list[Expr] | None = None
    for op in convert.ops:
        if isinstance(op, StackOp):
            values = {i: [Stack(tuple(exprs), op.dim)] for i, exprs in values.items()}
        elif isinstance(op, CatOp):
            parts = [e for i in sorted(values) for e in values[i]]
            values = {0: [Cat(tuple(parts), op.dim)]}
        elif isinstance(op, ChunkOp):
            (expr,) = [e for exprs in values.values() for e in exprs]
            count = len(convert.targets)
            outputs = [Chunk(expr, op.dim, j, count) for j in range(count)]
        elif isinstance(op, TransposeOp):
            values = {i: [Transpose(e, op.dim0, op.dim1) for e in exprs] for i, exprs in values.items()}
        else:
            raise MappingError(f"{first_name}: the conversion {convert!r} uses the operation {op!r}, which "
                               "lazyload cannot push a shard through; pass key_map= or a rule for this model.")
    if outputs is None:
        outputs = [e for exprs in values.values() for e in exprs]
    if len(outputs) == 1:
        return {first_name: outputs[0]}
    first_target = convert.targets[0]
    return {first_name.replace(first_target, target, 1): expr for target, expr in zip(convert.targets, outputs)}


# Keys that from_pretrained drops when the model has a buffer of that name ending (transformers
# PreTrainedModel._adjust_missing_and_unexpected_keys): buffers older versions saved, once
# persistent position_ids and rotary inv_freq once per layer, that the model now computes.
LEGACY_BUFFER_KEYS = {"rotary_emb.inv_freq": r"rotary_emb\.inv_freq", "position_ids": r"(^|\.)position_ids$"}


def _matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """Whether a name matches any of `patterns` (re.search), each compiled once."""
    compiled = [re.compile(p) for p in patterns]

    def matches(name: str) -> bool:  # a loop, not any() over a generator: asked for 46k keys at a time
        for regex in compiled:
            if regex.search(name):
                return True
        return False

    return matches


def _split(keys: Sequence[str], test: Callable[[str], bool] | None) -> tuple[list[str], list[str]]:
    """(the keys that pass `test`, the others), each in order; `test` asked once per key."""
    passed: list[str] = []
    rest: list[str] = []
    for key in keys:
        (passed if test is not None and test(key) else rest).append(key)
    return passed, rest


def build_mapping(index: CheckpointIndex, targets: MappingT[str, TargetSpec], *, aliases: MappingT[str, str] = {},
                  base_prefix: str = "", key_map: KeyMap | None = None, renames: Sequence = (),
                  converts: Sequence = (), ignore_unexpected: Sequence[str] = (),
                  ignore_missing: Sequence[str] = (), quant: Quantization = Quantization(),
                  buffers: Collection[str] = (), other_stage: Callable[[str], bool] | None = None,
                  give_up_unexpected: bool = False, held_apart: MappingT[str, str] = {}) -> Mapping | None:
    """Match checkpoint keys to model tensors. `aliases` maps a tied name to the target it
    shares storage with: a key for it fills that target unless the target has its own.
    `held_apart`: ties the model declares (tied -> source) whose tensors tensor parallelism
    made apart (AutoTP's lm_head): the source's tensor fills the tied one where it has none.
    `quant`: the checkpoint's quantized weights, each matched as its dequantization.

    `buffers`: the model's buffer names. A key naming one that is no target (a non-persistent
    buffer, e.g. position_ids that older versions saved), or a legacy key of LEGACY_BUFFER_KEYS,
    goes to `ignored_buffer_keys`, unread, as from_pretrained ignores it: the model computes
    the buffer.

    `other_stage`: whether a key belongs to a module the model left out as a pipeline stage
    (`other_stages`): such keys go to `other_stages`, unread, instead of being unexpected.

    `give_up_unexpected`: None as soon as a key would be unexpected (for a first mapping
    without conversion rules, which the caller then makes again with them)."""
    computed = set(buffers) - set(targets) - set(aliases)
    resolver = _Resolver(set(targets) | computed, aliases, base_prefix, key_map, renames, converts)
    leaf = lambda key: quant.leaves.get(key) or index.expr(key)  # noqa: E731
    left_over = _LeftOver(ignore_unexpected, quant, buffers, other_stage)
    matched = _match_keys(index, resolver, computed, aliases, quant, leaf,
                          left_over if give_up_unexpected else None)
    if matched is None:
        return None
    exprs = _with_converted(matched, aliases, leaf, index.shape_of)
    exprs.update({t: exprs[s] for t, s in held_apart.items() if t not in exprs and s in exprs})
    unexpected, legacy_keys, other_stages = left_over.split(matched.unexpected)
    ignored_missing = _matcher(ignore_missing)
    unfilled = [n for n in targets if n not in exprs]
    missing = [n for n in unfilled if not ignored_missing(n)]
    mismatched = _drop_unfit(exprs, targets, index, unexpected)
    return Mapping(exprs, missing, unexpected, mismatched,
                   ignored_buffer_keys=sorted(matched.ignored_buffer_keys + legacy_keys, key=natural_key),
                   other_stages=other_stages, expected_missing=[n for n in unfilled if n not in set(missing)])


@dataclass
class _Matched:
    """What each checkpoint name resolved to: expressions by target, those for tied names
    (by the target they share), per-source key groups of conversions, and the rest."""
    exprs: dict[str, Expr] = field(default_factory=dict)
    from_alias: dict[str, Expr] = field(default_factory=dict)
    groups: dict[str, tuple[Any, dict[int, list[str]]]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    ignored_buffer_keys: list[str] = field(default_factory=list)


def _match_keys(index: CheckpointIndex, resolver: _Resolver, computed: set[str], aliases: MappingT[str, str],
                quant: Quantization, leaf: Callable[[str], Expr], give_up: _LeftOver | None = None) -> _Matched | None:
    """Each checkpoint name (a tensor split over files is one name) to the target it fills;
    with `give_up`, None at the first key that stays unexpected."""
    matched = _Matched()
    exprs, from_alias, groups = matched.exprs, matched.from_alias, matched.groups
    for key in index.natural_names(quant.siblings):
        hit = resolver.resolve(quant.logical.get(key, key))  # MXFP4: X_blocks loads as X
        if hit is None:
            if give_up is not None and give_up.unexpected(key):
                return None
            matched.unexpected.append(key)
            continue
        name, convert, source_index = hit
        if name in computed:
            matched.ignored_buffer_keys.append(key)
        elif convert is not None:
            group = groups.get(name)  # not setdefault: it would build a defaultdict for each of 44k keys
            if group is None:
                group = groups[name] = (convert, defaultdict(list))
            group[1][source_index].append(key)
        elif name in aliases:
            from_alias.setdefault(aliases[name], leaf(key))
        elif name in exprs:
            raise MappingError(f"model tensor {name!r} is provided twice by the checkpoint: by "
                               f"{exprs[name]} and by {key!r}; drop one (key_map can rename it).")
        else:
            exprs[name] = leaf(key)
    return matched


def _with_converted(matched: _Matched, aliases: MappingT[str, str], leaf: Callable[[str], Expr],
                    shape_of: ShapeOf) -> dict[str, Expr]:
    """The matched expressions, with the conversions' built and a tied name's filling the
    target it shares where that target has none of its own."""
    exprs, from_alias = matched.exprs, matched.from_alias
    for first_name, (convert, by_source) in matched.groups.items():
        for name, expr in _build_converted(convert, by_source, first_name, leaf, shape_of).items():
            if name in aliases:
                from_alias.setdefault(aliases[name], expr)
            else:
                exprs[name] = expr
    for name, expr in from_alias.items():
        exprs.setdefault(name, expr)
    return exprs


class _LeftOver:
    """What becomes of a key that matches no target: ignored (`ignore_unexpected` or the
    quantization format's patterns), a legacy buffer key, another pipeline stage's, or unexpected."""

    def __init__(self, ignore_unexpected: Sequence[str], quant: Quantization, buffers: Collection[str],
                 other_stage: Callable[[str], bool] | None):
        self.ignored = _matcher((*ignore_unexpected, *quant.ignored))
        self.legacy = _matcher([p for suffix, p in LEGACY_BUFFER_KEYS.items()
                                if any(b.endswith(suffix) for b in buffers)])
        self.other_stage = other_stage

    def unexpected(self, key: str) -> bool:
        return not (self.ignored(key) or self.legacy(key) or self.other_stage is not None and self.other_stage(key))

    def split(self, unmatched: list[str]) -> tuple[list[str], list[str], list[str]]:
        """(unexpected, legacy buffer keys, other stages' keys) of `unmatched`, less the ignored."""
        unexpected = [k for k in unmatched if not self.ignored(k)]
        legacy_keys, unexpected = _split(unexpected, self.legacy)
        other_stages, unexpected = _split(unexpected, self.other_stage)
        return unexpected, legacy_keys, other_stages


def _drop_unfit(exprs: dict[str, Expr], targets: MappingT[str, TargetSpec], index: CheckpointIndex,
                unexpected: list[str]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Takes out of `exprs` those that fill no target (their keys join `unexpected`) and
    those of another shape than their target; returns the latter as (name, checkpoint
    shape, model shape)."""
    mismatched = []
    for name, expr in list(exprs.items()):
        if name not in targets:
            unexpected.extend(dict.fromkeys(index.name_of(k) for k in expr.keys()))
            del exprs[name]
            continue
        try:
            shape = expr.shape(index.shape_of)
        except ValueError as exc:
            raise MappingError(f"model tensor {name!r} cannot be built from {expr}: {exc}.") from exc
        if shape != targets[name].shape:
            mismatched.append((name, shape, targets[name].shape))
            del exprs[name]
    return mismatched


def _prefixes(names: Sequence[str], others: set[str]) -> dict[str, int]:
    """prefix -> how many of `names` are a name of `others` with that prefix in front."""
    counts: dict[str, int] = defaultdict(int)
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[i:]) in others:
                counts[".".join(parts[:i]) + "."] += 1
                break
    return counts


def prefix_hint(mapping: Mapping) -> str | None:
    """One line when the names differ by a common leading prefix: checkpoint keys with an
    extra one (`module.` from DDP) or model names with one the checkpoint lacks (a wrapper)."""
    missing, unexpected = mapping.missing, mapping.unexpected
    if not missing or not unexpected:
        return None
    for counts, lacks in ((_prefixes(unexpected, set(missing)), False), (_prefixes(missing, set(unexpected)), True)):
        if counts:
            prefix, n = max(counts.items(), key=lambda kv: kv[1])
            if 2 * n >= len(missing):
                escaped = re.escape(prefix)
                if lacks:
                    return (f"the model's names start with {prefix!r} where the checkpoint's keys do not ({n} of "
                            f"{len(missing)} missing); pass key_map={{r'^': '{prefix}'}} to add it.")
                return (f"the checkpoint's keys start with an extra {prefix!r} ({n} of {len(missing)} missing, e.g. "
                        f"saved from a DDP-wrapped model); pass key_map={{r'^{escaped}': ''}} to remove it.")
    return None


def _key_map_note(mapping: Mapping) -> str:
    if not mapping.unused_key_map:
        return ""
    return (f"\nkey_map patterns that match no checkpoint key: {', '.join(map(repr, mapping.unused_key_map))} "
            f"({KEY_MAP_HELP}).")


_NUMBERED = re.compile(r"^(.*?)\.(\d+)\.")


def _layer_counts(names: Sequence[str]) -> dict[str, int]:
    """Container of numbered layers ('model.layers') -> how many layer numbers its names use."""
    numbers: dict[str, set[int]] = defaultdict(set)
    for name in names:
        if (m := _NUMBERED.match(name)) is not None:
            numbers[m.group(1)].add(int(m.group(2)))
    return {container: len(n) for container, n in numbers.items()}


def layer_count_hint(model_names: Sequence[str], checkpoint_names: Sequence[str],
                     problems: Sequence[str]) -> str | None:
    """One line when the model and the checkpoint number another count of layers (a config
    that does not match the checkpoint) and `problems` (missing or unexpected names) lie in them."""
    in_model, in_checkpoint = _layer_counts(model_names), _layer_counts(checkpoint_names)
    for container in _layer_counts(problems):
        count = in_model.get(container)
        if count is not None and in_checkpoint.get(container, count) != count:
            return (f"the model has {count} layers and the checkpoint {in_checkpoint[container]} ({container}): check "
                    "the config (num_hidden_layers, or n_layer / num_layers) matches the checkpoint's config.json.")
    return None


def check_mapping(mapping: Mapping, index: CheckpointIndex, targets: MappingT[str, TargetSpec]) -> None:
    """Raise the first problem of a strict load, naming what is wrong and what to do."""
    layers = layer_count_hint(list(targets), index.names(), mapping.missing + mapping.unexpected)
    hint = layers or prefix_hint(mapping)
    first = f"{hint[0].upper()}{hint[1:]}\n" if hint else ""
    if mapping.missing:
        keys = index.names()
        lines = []
        for name in mapping.missing[:20]:
            near = difflib.get_close_matches(name, keys, n=3, cutoff=0.5)
            hint = f" (did you mean {', '.join(near)}?)" if near and not layers else ""
            lines.append(f"  {name}{hint}")
        more = f"\n  ... and {len(mapping.missing) - 20} more" if len(mapping.missing) > 20 else ""
        raise MissingKeysError(
            first + f"{len(mapping.missing)} model tensor(s) have no checkpoint tensor:\n" + "\n".join(lines) + more +
            "\nPass key_map= to rename checkpoint keys (checkpoint key -> model key), or strict=False to give "
            "them the model's own initialisation (missing='init')." + _key_map_note(mapping), mapping.missing)
    if mapping.unexpected:
        shown = "\n".join(f"  {k} (in {', '.join(index.files_of(k))})" for k in mapping.unexpected[:20])
        more = f"\n  ... and {len(mapping.unexpected) - 20} more" if len(mapping.unexpected) > 20 else ""
        raise UnexpectedKeysError(
            f"{first}{len(mapping.unexpected)} checkpoint tensor(s) match no model tensor:\n{shown}{more}\n"
            "Pass key_map= to map them (checkpoint key -> model key), or strict=False to ignore them."
            + _key_map_note(mapping), mapping.unexpected)
    if mapping.mismatched:
        shown = "\n".join(f"  {name}: checkpoint shape {list(c)}, model shape {list(m)}"
                          for name, c, m in mapping.mismatched[:20])
        raise ShapeMismatchError(
            f"{len(mapping.mismatched)} tensor(s) differ in shape between checkpoint and model:\n{shown}\n"
            "Check that the model config matches the checkpoint.", mapping.mismatched)


def check_casts(mapping: Mapping, index: CheckpointIndex, dtypes: MappingT[str, torch.dtype]) -> None:
    """A floating or complex checkpoint tensor cannot fill an integer or bool tensor."""
    for name, expr in mapping.exprs.items():
        target = dtypes[name]
        if target.is_floating_point or target.is_complex:
            continue
        for key in expr.keys():
            source = index[key].dtype
            if source.is_floating_point or source.is_complex:
                raise DtypeError(f"{name}: checkpoint tensor {key!r} in {index[key].file} is {source}, which cannot "
                                 f"be cast to the model's {target} without losing its values; fix the model's "
                                 "dtype or the checkpoint.")


def _conversion_rules(model: nn.Module) -> tuple[list, list]:
    from .hf_rules import hf_rules  # imports transformers: only when plain names fall short

    rules = hf_rules(model)
    if rules is not None:
        return rules
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return rules_from(BUILTIN_RULES.get(model_type, []))


def held_by(model: nn.Module, specs: dict) -> Any:
    """Whether the model holds a checkpoint key itself (by name, with its base prefix added
    or removed): a model with its own 8-bit weights and scales loads them as stored."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    renames, converts = _conversion_rules(model) if fp8_quantizer(model) is not None else ([], [])
    stacked = scale_conversions(converts)  # per-expert FP8 scales stacked into transformers' FP8Experts
    resolver = _Resolver(specs, {}, prefix, None, renames, stacked) if stacked else None

    def held(key: str) -> bool:
        if key in specs or bool(prefix) and (f"{prefix}.{key}" in specs or key.removeprefix(prefix + ".") in specs):
            return True
        return resolver is not None and resolver.resolve(key) is not None

    return held


def other_stages(model: nn.Module) -> Callable[[str], bool] | None:
    """Whether a checkpoint key belongs to a module this model left out as a pipeline stage
    does (torch.distributed.pipelining's manual split, torchtitan): a registered child set
    to None (a layer of a ModuleList, `embed_tokens`, `norm`, `lm_head`), or a layer number
    missing from a ModuleDict of numbered layers (below the config's `num_hidden_layers`
    when the model has one). Both are traces of a removal that keeps the other layers'
    numbers; a ModuleList that is only shorter is no stage (its layers are renumbered), and
    its extra checkpoint layers stay unexpected. None when the model left nothing out."""
    removed: set[str] = set()
    numbered: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        removed.update(prefix + child for child, sub in module._modules.items() if sub is None)
        if isinstance(module, nn.ModuleDict) and module._modules and all(k.isdigit() for k in module._modules):
            numbered[name] = set(module._modules)
    if not removed and not numbered:
        return None
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None)

    def under(name: str) -> bool:
        parts = name.split(".")
        for i in range(1, len(parts)):
            head, child = ".".join(parts[:i]), parts[i]
            if head in removed or (head in numbered and child.isdigit() and child not in numbered[head]
                                   and (layers is None or int(child) < layers)):
                return True
        return False

    base = getattr(model, "base_model_prefix", "") or ""
    return lambda key: under(key) or bool(base) and (under(f"{base}.{key}") or (
        key.startswith(base + ".") and under(key[len(base) + 1:])))


@no_cycle_collection()  # up to 100k expressions, no cycles
def map_model(index: CheckpointIndex, model: nn.Module, specs: MappingT[str, TargetSpec],
              aliases: MappingT[str, str], key_map: KeyMap | None = None,
              quant: Quantization | None = None) -> Mapping:
    """Match checkpoint keys to the model's tensors. The conversion rules are fetched only
    when plain names do not match everything (building transformers' table costs ~0.2 s);
    names that match plainly are never converted, so the result is the same. `quant`: the
    checkpoint's quantized weights (default: detected from its tensors alone)."""
    unused = check_key_map(key_map, list(index.keys()))
    quant = detect(index, held=held_by(model, specs)) if quant is None else quant
    stage = other_stages(model)
    held_apart = {t: s for t, s in (getattr(model, "all_tied_weights_keys", None) or {}).items()
                  if t in specs and s in specs and t != s}

    def with_rules(renames, converts, give_up_unexpected=False):
        mapping = build_mapping(
            index, specs, aliases={a: c for a, c in aliases.items() if c in specs},
            base_prefix=getattr(model, "base_model_prefix", "") or "", key_map=key_map,
            renames=renames, converts=converts,
            ignore_unexpected=list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []),
            ignore_missing=list(getattr(model, "_keys_to_ignore_on_load_missing", None) or []), quant=quant,
            buffers=[name for name, _ in model.named_buffers(remove_duplicate=False)], other_stage=stage,
            give_up_unexpected=give_up_unexpected, held_apart=held_apart)
        return mapping and replace(mapping, unused_key_map=unused)

    # An unexpected key without the rules means mapping again with them: the first pass stops
    # there (DeepSeek-V3: at its first per-expert key, not after all 46k names).
    mapping = with_rules([], [], give_up_unexpected=True)
    if mapping is None or mapping.missing or mapping.unexpected or mapping.mismatched:
        mapping = with_rules(*_conversion_rules(model))
    return mapping
