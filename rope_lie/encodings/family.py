"""What a family is, and how its settings travel with it.

- ``Family``: a family's description of itself, declared once in its module as ``FAMILY``: its
  kind, the position convention of its reference, whether q.k depends on p' - p only, the
  settings ``apply`` needs (with ``init``'s defaults), its stored parameter count by formula
  from the documented shapes, example settings for tests, and named variants. The model, the
  recipes, the demo and the tests read these instead of keeping tables of their own.
- ``Encoder``: every static setting of one encoder in one hashable value, with ``init``,
  ``precompute``, ``apply`` (rotary) and ``bias`` (ALiBi), optax's design
  (``docs/encoders.md``, section 1, says why). ``encoder(name, ...)`` makes one and checks the
  settings at once. Parameters stay plain dicts of arrays.
- ``Params``: what a family module's own ``init`` returns: the dict of arrays tagged with the
  ``Encoder`` that made it (pytree auxiliary data, so the tag crosses ``jit``, ``vmap``,
  ``grad`` and ``jax.tree.map``). The module's ``apply(params, x, pos)`` and
  ``precompute(params, pos, ...)`` use the tagged settings (``bound``): a setting passed that
  differs from init's, or parameters of another family, is an error, never another rotation.
  A plain dict (parameters from a checkpoint, or wrapped by a framework) carries no settings:
  those calls then use what they are given, else the family's defaults.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

KINDS = ("rotary", "bias")
# init's arguments that every rotary and bias family shares; the rest are its settings.
SHAPE_ARGS = ("num_heads", "head_dim", "num_axes")


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """A family's description of itself (its module's ``FAMILY``).

    Attributes:
      name: the family's name, its module's name and its key in ``encodings.ROTARY``/``BIAS``.
      kind: ``"rotary"`` (``apply`` turns q and k) or ``"bias"`` (a logit bias, ALiBi).
      convention: the position convention of the family's reference
        (``positions.CONVENTIONS``): what the model and the adapters use unless told otherwise.
      relative: True when q.k depends on p' - p only for every setting (the generators
        commute); LieRE is not (dense 2D/3D generators do not commute).
      apply_defaults: the settings ``apply``/``precompute``/``bias`` also need, with the
        defaults of ``init``.
      stored_count: ``(num_heads, head_dim, num_axes, settings) -> int``, the scalars one set
        of parameters stores, from the documented shapes (every setting filled in).
      examples: ``(settings, position ranks)`` for tests: one per code path; the first is
        valid at head_dim 8, 12 and 16 for every rank it lists and turns q and k at generic
        positions (the model tests use it).
      variants: named variants that reproduce another paper's baseline, for a recipe's
        ``pe=``: ``{pe: (settings, convention)}``.
      pair_spectrum: fixed-frequency families: ``(head_dim, num_axes, settings) -> (axis_F,
        freq_F)``, the pair table before p-RoPE (pair j turns by ``pos[axis_F[j]] *
        freq_F[j]``; settings as ``Encoder.hparams``). The extrapolation tools' NTK and YaRN
        rescale it (``encodings/extrapolation.py``). None for the others.
      learned_frequencies: the parameter holding learned pair frequencies ``(A, N, F)`` (pair
        j of head n turns by ``sum_a pos_a f[a, n, j]``), which YaRN rescales; None when there
        is none.
    """

    name: str
    kind: str
    convention: str
    relative: bool
    apply_defaults: Mapping[str, Any]
    stored_count: Callable[[int, int, int, Mapping[str, Any]], int]
    examples: tuple[tuple[Mapping[str, Any], tuple[int, ...]], ...]
    variants: Mapping[str, tuple[Mapping[str, Any], str]] = dataclasses.field(default_factory=dict)
    pair_spectrum: Callable[[int, int, Mapping[str, Any]], tuple[np.ndarray, np.ndarray]] | None = (
        None
    )
    learned_frequencies: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind={self.kind!r}; expected one of {KINDS}")
        if not self.examples:
            raise ValueError(f"{self.name}: a family declares at least one example")

    @property
    def module(self):
        """The family's module, ``rope_lie.encodings.<name>``."""
        return importlib.import_module(f"{__package__}.{self.name}")

    def settings_of_init(self) -> dict[str, Any]:
        """Every setting ``init`` takes besides the key and the shape arguments, with its
        default (``inspect.Parameter.empty`` when it has none)."""
        parameters = inspect.signature(self.module.init).parameters
        return {
            name: p.default
            for name, p in parameters.items()
            if name != "key" and name not in SHAPE_ARGS
        }


def _frozen(value: Any) -> Any:
    """A setting as a hashable value: lists and tuples as tuples, numpy scalars as Python ones."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


@dataclasses.dataclass(frozen=True)
class Encoder:
    """One encoder: its family and every static setting, a hashable value (``encoder()``).

    Attributes:
      name: the family (a key of ``encodings.ROTARY`` or ``encodings.BIAS``).
      num_heads: N of the parameters (1 when the heads share them: the states broadcast).
      head_dim: H.
      num_axes: A, position axes (1, 2 or 3).
      settings: every other argument of the family's ``init``, defaults filled in, sorted by
        name (``hparams`` gives them as a dict).
    """

    name: str
    num_heads: int
    head_dim: int
    num_axes: int
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def family(self) -> Family:
        return self.module.FAMILY

    @property
    def module(self):
        return importlib.import_module(f"{__package__}.{self.name}")

    @property
    def hparams(self) -> dict[str, Any]:
        """The settings as ``init``'s keyword arguments."""
        return dict(self.settings)

    @property
    def apply_hparams(self) -> dict[str, Any]:
        """The settings ``apply``/``precompute``/``bias`` take (``Family.apply_defaults``)."""
        return {k: v for k, v in self.settings if k in self.family.apply_defaults}

    @property
    def convention(self) -> str:
        """The position convention of the family's reference."""
        return self.family.convention

    def _shape_kwargs(self) -> dict[str, int]:
        return dict(num_heads=self.num_heads, head_dim=self.head_dim, num_axes=self.num_axes)

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """The family's parameters: a plain dict of float32 arrays (``{}`` when it has none)."""
        return dict(self.module.init(key, **self._shape_kwargs(), **self.hparams))

    def _own(self, params: Mapping[str, jax.Array]) -> Params:
        """``params`` tagged with this encoder, so that the module checks the call's shapes
        against these settings (a plain dict carries none); tagged by another, an error."""
        made = getattr(params, "encoder", None)
        if made is None:
            return Params(params, self)
        if made != self:
            raise ValueError(f"these parameters were made by {made}, not by this {self}")
        return params

    def precompute(self, params: Mapping[str, jax.Array], pos: jax.Array, *, num_prefix: int = 0):
        """The encoder state at positions ``pos_TA`` or ``pos_BTA`` (``encodings/state.py``):
        ``state.rotate(q)``, ``state.rotate(k)``, and ``state.bias_BNTS`` for ALiBi."""
        return self.module.precompute(
            self._own(params),
            pos,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_prefix=num_prefix,
            **self.apply_hparams,
        )

    def apply(self, params: Mapping[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array):
        """``R(p) x`` for queries or keys (rotary families): ``precompute`` then ``rotate``.

        For q and k, ``precompute`` once and rotate both: the state is the costly part.
        """
        if self.family.kind != "rotary":
            raise ValueError(
                f"{self.name} is a {self.family.kind} family: it has no apply; use "
                "precompute(...).bias_BNTS or bias(...)"
            )
        return self.module.apply(self._own(params), x_BTNH, pos, **self.apply_hparams)

    def bias(
        self,
        params: Mapping[str, jax.Array],
        pos_q: jax.Array,
        pos_k: jax.Array,
        *,
        num_prefix: int = 0,
    ) -> jax.Array:
        """The logit bias between query and key positions (bias families): ``bias_NTS``, or
        ``bias_BNTS`` for per-example positions."""
        if self.family.kind != "bias":
            raise ValueError(f"{self.name} is a {self.family.kind} family: it has no bias")
        return self.module.bias(
            self._own(params),
            pos_q,
            pos_k,
            num_heads=self.num_heads,
            num_prefix=num_prefix,
            **self.apply_hparams,
        )

    def param_count(self) -> int:
        """Stored scalars of one set of parameters, by the family's formula."""
        return int(self.family.stored_count(*self._shape_kwargs().values(), self.hparams))


def encoder(name: str, *, num_heads: int, head_dim: int, num_axes: int, **settings) -> Encoder:
    """An ``Encoder``: family ``name`` with these settings, checked now (by tracing ``init``).

    Args:
      name: a rotary or bias family (``encodings.ROTARY``, ``encodings.BIAS``).
      num_heads: N of the parameters (1 to share them across heads).
      head_dim: H.
      num_axes: A, position axes (1, 2 or 3).
      **settings: the family's ``init`` keyword arguments; the rest take their defaults.

    Returns:
      the ``Encoder``.

    Raises:
      ValueError: for an unknown family or setting, or settings ``init`` refuses.
    """
    family = family_of(name)
    known = family.settings_of_init()
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(
            f"{name}: unknown setting(s) {unknown}; {name} takes {sorted(known) or 'none'}"
        )
    # The module's init validates every setting and tags its result with the Encoder of them,
    # defaults filled in and normalised; traced abstractly, it allocates nothing.
    abstract = jax.eval_shape(
        lambda key: family.module.init(
            key, num_heads=num_heads, head_dim=head_dim, num_axes=num_axes, **settings
        ),
        jax.random.key(0),
    )
    return abstract.encoder


def family_of(name: str) -> Family:
    """The ``Family`` of a rotary or bias family's name."""
    from rope_lie import encodings

    module = encodings.ROTARY.get(name) or encodings.BIAS.get(name)
    if module is None:
        if name in encodings.ADDITIVE:
            raise ValueError(
                f"{name} is an additive table, not an encoder of q and k: use "
                f"encodings.ADDITIVE[{name!r}].table"
            )
        raise ValueError(
            f"unknown family {name!r}; expected one of "
            f"{sorted(encodings.ROTARY) + sorted(encodings.BIAS)}"
        )
    return module.FAMILY


class Params(dict):
    """A family module's ``init`` result: its arrays, tagged with the ``Encoder`` that made them.

    A ``dict`` (``params["freqs_ANF"]``, ``dict(params)``) and a pytree whose auxiliary data is
    ``encoder``, so the tag survives ``jit``, ``vmap``, ``grad`` and ``jax.tree.map``.
    Checkpoints and framework wrappers (``nnx.Param``, Linen variables) keep the arrays, not the
    tag: that is what ``Encoder`` is for.
    """

    __slots__ = ("encoder",)

    def __init__(self, arrays: Mapping[str, Any], encoder: Encoder):
        super().__init__(arrays)
        self.encoder = encoder

    def __repr__(self) -> str:
        return f"Params({dict.__repr__(self)}, encoder={self.encoder!r})"

    def __reduce__(self):
        return Params, (dict(self), self.encoder)


def _flatten_with_keys(params: Params):
    names = tuple(sorted(params))
    children = [(jax.tree_util.DictKey(n), params[n]) for n in names]
    return children, (names, params.encoder)


def _flatten(params: Params):
    names = tuple(sorted(params))
    return [params[n] for n in names], (names, params.encoder)


def _unflatten(aux, children) -> Params:
    names, enc = aux
    return Params(dict(zip(names, children, strict=True)), enc)


jax.tree_util.register_pytree_with_keys(Params, _flatten_with_keys, _unflatten, _flatten)


def _serialize_aux(aux) -> bytes:
    names, enc = aux
    return json.dumps({"names": names, "encoder": dataclasses.asdict(enc)}).encode()


def _deserialize_aux(data: bytes):
    aux = json.loads(data)
    fields = aux["encoder"]
    fields["settings"] = _frozen(fields["settings"])
    return tuple(aux["names"]), Encoder(**fields)


# A function that takes tagged parameters can be exported and serialised (jax.export).
jax.export.register_pytree_node_serialization(
    Params,
    serialized_name="rope_lie.encodings.Params",
    serialize_auxdata=_serialize_aux,
    deserialize_auxdata=_deserialize_aux,
)


def params(
    name: str,
    arrays: Mapping[str, Any],
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    **settings,
) -> Params:
    """``arrays`` tagged with the ``Encoder`` of these settings (what a module's ``init``
    returns; the settings are every one ``init`` was given or defaulted)."""
    frozen = tuple(sorted((k, _frozen(v)) for k, v in settings.items()))
    return Params(arrays, Encoder(name, num_heads, head_dim, num_axes, frozen))


class _AsInit:
    """The default of a setting in ``apply``/``precompute``: what ``init`` was given."""

    def __repr__(self) -> str:
        return "<as given to init>"


INIT = _AsInit()


def bound(params: Mapping[str, Any], name: str, **given) -> dict[str, Any]:
    """The settings an ``apply``/``precompute``/``bias`` call uses.

    Tagged parameters (``Params`` from the module's ``init``) give init's settings; a setting
    also passed must equal it. Plain dicts give what was passed, else the family's defaults.

    Args:
      params: the parameters the call received.
      name: the family being called.
      **given: the call's settings (``INIT`` where not passed).

    Returns:
      ``{setting: value}`` for every name in ``given``.

    Raises:
      ValueError: parameters of another family, or a setting that differs from init's.
    """
    enc = _made_by(params, name)
    if enc is None:
        defaults = family_of(name).apply_defaults
        return {k: defaults[k] if v is INIT else v for k, v in given.items()}
    made = enc.hparams
    for k, v in given.items():
        if v is not INIT and _frozen(v) != made[k]:
            raise ValueError(
                f"{name}: {k}={v!r} was passed, but init was given {k}={made[k]!r}; the "
                "parameters carry init's settings: pass none, or the same"
            )
    return {k: made[k] for k in given}


def check_made_for(params: Mapping[str, Any], name: str, **shape: int) -> None:
    """For tagged parameters: the call's shapes (``num_heads``, ``head_dim``, ``num_axes``)
    must be those init was given (parameter-free families have no arrays to check them by)."""
    enc = _made_by(params, name)
    if enc is None:
        return
    for what, value in shape.items():
        want = getattr(enc, what)
        if value != want:
            raise ValueError(f"{name}: {what}={value} here, but init was given {what}={want}")


def _made_by(params: Mapping[str, Any], name: str) -> Encoder | None:
    enc = getattr(params, "encoder", None)
    if enc is not None and enc.name != name:
        raise ValueError(f"{name}: these parameters were made by {enc.name}.init, not {name}.init")
    return enc
