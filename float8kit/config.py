"""All float8kit configuration: enums, frozen dataclasses and named recipes.

Every dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the
offending field and the fix, so a bad config fails at construction, not inside a gemm.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import ClassVar

import torch

# The two float8 formats, defined once. e4m3 has more mantissa (inputs, weights); e5m2 more
# range (gradients). ``fn`` = finite: e4m3fn has NaN but no inf.
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)


def _require_bools(obj, *names: str) -> None:
    """Raise naming the field where one of ``names`` of ``obj`` is not a bool."""
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ValueError(f"{type(obj).__name__}.{name}={getattr(obj, name)!r} must be a bool")


def _require_int(obj, name: str, least: int, why: str) -> None:
    """Raise naming the field where ``obj.name`` is not an int >= ``least``."""
    n = getattr(obj, name)
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise ValueError(f"{type(obj).__name__}.{name}={n!r} must be an int >= {least} ({why})")


class ScalingType(enum.Enum):
    """Where an operand's scale comes from."""

    DYNAMIC = "dynamic"  # amax of the tensor being cast, now
    DELAYED = "delayed"  # from an amax history that precompute_scales updates once per step
    STATIC = "static"  # a fixed scale: CastConfig.static_scale or float8kit.calibrate
    DISABLED = "disabled"  # not cast: the gemm that uses this operand runs in hp

    @property
    def stateful(self) -> bool:
        """True for the policies that keep per-layer scale state (DELAYED, STATIC)."""
        return self in (ScalingType.DELAYED, ScalingType.STATIC)


class ScalingGranularity(enum.Enum):
    """How many scales an operand has."""

    TENSORWISE = "tensorwise"  # one scale for the whole tensor
    AXISWISE = "axiswise"  # one scale per row of the left operand / column of the right one
    # DeepSeek-V3 style: the weight in block_size x block_size blocks, input and grad_output
    # in 1 x block_size tiles along the inner dim of each gemm
    BLOCKWISE = "blockwise"
    # OCP MX (MXFP8): one power-of-two scale, stored as an e8m0 byte, per 32 consecutive
    # elements along the dim each gemm reduces (every operand of every gemm: the weight
    # and the activations alike are cast once per gemm that uses them)
    MX = "mx"
    # NVFP4 (Blackwell): e2m1 elements, one e4m3 scale per 16 consecutive elements along the
    # dim each gemm reduces and one fp32 scale per tensor (two levels); weights in 16x16
    # blocks, so that one cast serves both of the weight's gemms (float8kit/formats/nvfp4.py)
    NVFP4 = "nvfp4"


# NVFP4: elements per e4m3 block scale (a weight block is NVFP4_BLOCK x NVFP4_BLOCK)
NVFP4_BLOCK = 16
# OCP MX: elements per e8m0 scale (the spec's and the Blackwell kernel's only block)
MX_BLOCK = 32
# How an MX scale is rounded from amax / fp8_max (``MXGranularity.scale_rounding``):
# "rceil" = up to the next power of two (nothing saturates; torchao's, torchtitan's and
# Transformer Engine's training recipes, cuBLAS's rule); "floor" = the OCP spec's
# reference (floor of amax's exponent minus fp8_max's: the largest values may saturate)
MX_ROUNDINGS = ("rceil", "floor")


class GranularitySettings:
    """A granularity with settings, named by a value (``CastConfig(scaling_granularity=
    BlockwiseGranularity(block_size=64))``; its ``ScalingGranularity`` member alone means its
    defaults). It validates its own fields and answers what config validation asks of it."""

    kind: ClassVar[ScalingGranularity]
    # what the error says when a gemm's two operands need different kernels
    pairing: ClassVar[str]
    # what config validation asks of it, as data (``CastConfig.option``): its scales are
    # powers of two (exact to dequantize), an FSDP2 float8 all-gather gathers each gemm's own
    # cast (one per pass), its kernel has fast accumulation, its elements are a float8 dtype
    power_of_2_scales: ClassVar[bool] = False
    gathers_per_pass: ClassVar[bool] = False
    fast_accum: ClassVar[bool] = True
    float8_elements: ClassVar[bool] = True

    @property
    def kernel(self) -> tuple:
        """The block-scaled kernel its operands need: both operands of a gemm need the same."""
        return (self.kind,)

    def check_use(self, field: str, role: GemmRole) -> None:
        """Raise naming ``field`` where the settings do not fit an operand of ``role``."""

    def check_gemm(self, gemm: str, left: tuple, right: tuple) -> None:
        """Raise where the settings of a gemm's two casts (``(field, CastConfig)`` each, both
        of this granularity) do not go together."""


@dataclasses.dataclass(frozen=True)
class BlockwiseGranularity(GranularitySettings):
    """``ScalingGranularity.BLOCKWISE`` with its setting (DeepSeek-V3's 128 by default)."""

    kind: ClassVar[ScalingGranularity] = ScalingGranularity.BLOCKWISE
    pairing: ClassVar[str] = "a block-scaled gemm needs both operands blockwise, same block_size"
    # the side of a weight block and the length of an input/grad_output tile (CUDA: 128 only)
    block_size: int = 128

    def __post_init__(self):
        _require_int(self, "block_size", 1, "128 for the CUDA kernel")

    @property
    def kernel(self) -> tuple:
        return (self.kind, self.block_size)  # a kernel per block size

    def short(self) -> str:
        return f"block{self.block_size}"


@dataclasses.dataclass(frozen=True)
class MXGranularity(GranularitySettings):
    """``ScalingGranularity.MX`` (MXFP8) with its setting: how the e8m0 scale of a 32-element
    block is rounded, ``"rceil"`` (default: the power of two at or above amax / fp8_max) or
    ``"floor"`` (the OCP spec's rounding); see ``MX_ROUNDINGS``."""

    kind: ClassVar[ScalingGranularity] = ScalingGranularity.MX
    pairing: ClassVar[str] = "an MX gemm needs both operands MX"
    power_of_2_scales: ClassVar[bool] = True
    gathers_per_pass: ClassVar[bool] = True
    fast_accum: ClassVar[bool] = False  # its kernel scales every 32 products in fp32
    scale_rounding: str = "rceil"

    def __post_init__(self):
        if self.scale_rounding not in MX_ROUNDINGS:
            raise ValueError(
                f"MXGranularity.scale_rounding={self.scale_rounding!r} is not valid: use "
                "'rceil' (the power of two at or above amax / fp8_max) or 'floor'"
            )

    def short(self) -> str:
        return f"mx{MX_BLOCK}{self.scale_rounding}"


@dataclasses.dataclass(frozen=True)
class NVFP4Granularity(GranularitySettings):
    """``ScalingGranularity.NVFP4`` with its settings. ``stochastic_rounding``: grad_output
    casts only: round the e2m1 elements stochastically (unbiased; fresh draws from torch's
    generator every backward) instead of to nearest. ``hadamard``: the grad_weight gemm's
    casts only (both of its operands alike): the 16x16 random Hadamard transform along the
    token dim before the cast."""

    kind: ClassVar[ScalingGranularity] = ScalingGranularity.NVFP4
    pairing: ClassVar[str] = "an NVFP4 gemm needs both operands NVFP4"
    float8_elements: ClassVar[bool] = False  # e2m1 elements, e4m3 block scales
    stochastic_rounding: bool = False
    hadamard: bool = False

    def __post_init__(self):
        _require_bools(self, "stochastic_rounding", "hadamard")

    def short(self) -> str:
        return f"nvfp4{'_sr' * self.stochastic_rounding}{'_rht' * self.hadamard}"

    def check_use(self, field, role):
        if self.stochastic_rounding and role is not GemmRole.GRAD_OUTPUT:
            raise ValueError(
                f"Float8LinearConfig.{field} has stochastic_rounding=True, but only gradients "
                "are rounded stochastically (an input or weight rounded so would add noise to "
                "the forward pass): set it on cast_config_grad_output / "
                "cast_config_grad_output_for_grad_weight"
            )

    def check_gemm(self, gemm, left, right):
        # a Hadamard transform is exact only when both operands of the grad_weight gemm get it
        (lname, lcfg), (rname, rcfg) = left, right
        lh, rh = lcfg.option("hadamard"), rcfg.option("hadamard")
        if (lh or rh) and gemm != "grad_weight":
            raise ValueError(
                f"Float8LinearConfig.{lname if lh else rname} has hadamard=True, but the "
                "Hadamard transform applies to the grad_weight gemm only (along the tokens it "
                f"reduces), not the {gemm} gemm: set hadamard=True on "
                "cast_config_input_for_grad_weight and cast_config_grad_output_for_grad_weight only"
            )
        if lh != rh:
            raise ValueError(
                f"Float8LinearConfig: the grad_weight gemm has {lname} hadamard={lh} but "
                f"{rname} hadamard={rh}; the transform cancels only when both operands get it: "
                "set both or neither"
            )


# the granularities with settings, by their member: the member alone means these defaults
GRANULARITY_OPTIONS = {c.kind: c for c in (BlockwiseGranularity, MXGranularity, NVFP4Granularity)}


class GemmRole(enum.Enum):
    """Which operand of a linear layer a float8 tensor stands for."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


# The roles in order, as a tuple: code that runs inside a traced forward iterates this, never
# the Enum class (torch 2.11's dynamo cannot inline ``EnumType.__iter__``).
GEMM_ROLES: tuple[GemmRole, ...] = (GemmRole.INPUT, GemmRole.WEIGHT, GemmRole.GRAD_OUTPUT)


@dataclasses.dataclass(frozen=True)
class GemmOperand:
    """One operand of one of a linear layer's gemms."""

    role: GemmRole
    # the Float8LinearConfig field that casts it for this gemm
    cast_field: str
    # the operand's dim this gemm reduces: where its axiswise and block scales run
    reduce_dim: int


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One of a linear layer's three gemms: ``left @ right``, with its two operands."""

    name: str
    left: GemmOperand
    right: GemmOperand
    # what the inner dim K and the output dim N are, for error messages
    inner_dim: str
    out_dim: str

    @property
    def config_field(self) -> str:
        """Its ``GemmConfig`` field of ``Float8LinearConfig``."""
        return f"gemm_config_{self.name}"


# The three gemms of a linear layer, the table every module reads (written nowhere else):
#   output      = input (M,K)         @ weight.T (K,N)   reduce K: input dim -1, weight dim -1
#   grad_input  = grad_output (M,N)   @ weight (N,K)     reduce N: grad_output -1, weight 0
#   grad_weight = grad_output.T (N,M) @ input (M,K)      reduce M: grad_output 0, input 0
_IN, _W, _GO = GemmRole.INPUT, GemmRole.WEIGHT, GemmRole.GRAD_OUTPUT
GEMMS: tuple[Gemm, ...] = (
    Gemm(
        "output",
        GemmOperand(_IN, "cast_config_input", -1),
        GemmOperand(_W, "cast_config_weight", -1),
        "in_features",
        "out_features",
    ),
    Gemm(
        "grad_input",
        GemmOperand(_GO, "cast_config_grad_output", -1),
        GemmOperand(_W, "cast_config_weight_for_grad_input", 0),
        "out_features",
        "in_features",
    ),
    Gemm(
        "grad_weight",
        GemmOperand(_GO, "cast_config_grad_output_for_grad_weight", 0),
        GemmOperand(_IN, "cast_config_input_for_grad_weight", 0),
        "the token count (the input's leading dims flattened)",
        "in_features",
    ),
)
# operand role -> (its cast field in its first gemm, in its second gemm), in GEMM_ROLES' order
OPERAND_USES: dict[GemmRole, tuple[str, str]] = {
    role: tuple(
        op.cast_field for gemm in GEMMS for op in (gemm.left, gemm.right) if op.role is role
    )
    for role in GEMM_ROLES
}


def _coerce_enum(obj, field: str, enum_cls: type[enum.Enum]) -> None:
    """Accept an enum member or its string value; raise naming ``field`` otherwise."""
    value = getattr(obj, field)
    if isinstance(value, enum_cls):
        return
    valid = ", ".join(repr(m.value) for m in enum_cls)
    if isinstance(value, str):
        try:
            object.__setattr__(obj, field, enum_cls(value.lower()))
            return
        except ValueError:
            pass
    raise ValueError(
        f"{type(obj).__name__}.{field}={value!r} is not valid: use a {enum_cls.__name__} "
        f"member or one of {valid}"
    )


# 0.4's CastConfig fields that are now a granularity's settings: field -> its setting's name
_MOVED_SETTINGS = {
    "block_size": "block_size",
    "mx_scale_rounding": "scale_rounding",
    "stochastic_rounding": "stochastic_rounding",
    "hadamard": "hadamard",
}

# CastConfig settings that one scaling type uses: (field, its default, the field that selects
# it, the value it needs there)
_ONLY_WITH = (
    ("amax_history_len", 16, "scaling_type", ScalingType.DELAYED),
    ("delayed_scale_from", "max", "scaling_type", ScalingType.DELAYED),
    ("static_scale", None, "scaling_type", ScalingType.STATIC),
)


@dataclasses.dataclass(frozen=True)
class CastConfig:
    """How one operand of one gemm is cast to float8.

    Args:
        scaling_type: where the scale comes from (``ScalingType`` or its string value).
        scaling_granularity: how many scales: a ``ScalingGranularity`` member (or its
            string value), or a granularity with its settings: ``BlockwiseGranularity``,
            ``MXGranularity``, ``NVFP4Granularity`` (the member alone: their defaults).
            Stored as the member, its settings in ``granularity_options``.
        target_dtype: the float8 dtype; None picks the role's default (e4m3 for input and
            weight, e5m2 for grad_output when tensorwise, e4m3 everywhere when axiswise).
        amax_history_len: DELAYED only: how many steps' amaxes the history keeps.
        delayed_scale_from: DELAYED only: ``"max"`` scales from the largest amax in the
            history (robust to a shrinking range), ``"most_recent"`` from the last step's.
        static_scale: STATIC only: the fixed scale (``fp8 = saturate(hp * static_scale)``);
            None = set per layer by ``float8kit.calibrate``. Required for grad_output.
        granularity_options: the settings of a granularity that has them, filled from
            ``scaling_granularity`` (whose value wins where both are given, as
            ``dataclasses.replace`` gives them); None for tensorwise and axiswise.
    """

    # where the scale comes from
    scaling_type: ScalingType = ScalingType.DYNAMIC
    # one scale per tensor, one per row of the left / column of the right gemm operand, or
    # per block; a member or a granularity value with settings (BlockwiseGranularity, ...)
    scaling_granularity: ScalingGranularity | GranularitySettings = ScalingGranularity.TENSORWISE
    # float8 dtype to cast to; None = the role's default
    target_dtype: torch.dtype | None = None
    # DELAYED: number of steps in the amax history
    amax_history_len: int = 16
    # DELAYED: "max" (largest amax in the history) or "most_recent" (last step's amax)
    delayed_scale_from: str = "max"
    # STATIC: the fixed scale; None = per layer from float8kit.calibrate
    static_scale: float | None = None
    # the granularity's settings (BlockwiseGranularity, MXGranularity, NVFP4Granularity):
    # filled from scaling_granularity, None where it has none
    granularity_options: GranularitySettings | None = None

    def __post_init__(self):
        _coerce_enum(self, "scaling_type", ScalingType)
        self._split_granularity()
        if self.target_dtype is not None and self.target_dtype not in FP8_DTYPES:
            raise ValueError(
                f"CastConfig.target_dtype={self.target_dtype} is not a float8 dtype: use "
                "torch.float8_e4m3fn, torch.float8_e5m2 or None (the role's default)"
            )
        if self.scaling_type.stateful and (
            self.scaling_granularity is not ScalingGranularity.TENSORWISE
        ):
            raise ValueError(
                f"CastConfig.scaling_granularity={self.scaling_granularity.value!r} is not "
                f"supported with scaling_type={self.scaling_type.value!r}: delayed and static "
                "scaling are tensorwise only; use ScalingGranularity.TENSORWISE (or DYNAMIC "
                "scaling for axiswise and blockwise)"
            )
        _require_int(self, "amax_history_len", 1, "steps of amax history")
        if self.delayed_scale_from not in ("max", "most_recent"):
            raise ValueError(
                f"CastConfig.delayed_scale_from={self.delayed_scale_from!r} is not valid: use "
                "'max' or 'most_recent'"
            )
        s = self.static_scale
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < math.inf:
                raise ValueError(
                    f"CastConfig.static_scale={s!r} must be a positive finite number "
                    "(fp8 = saturate(hp * static_scale)); e.g. fp8_max / expected_amax"
                )
            object.__setattr__(self, "static_scale", float(s))
        # a setting that only one policy uses, set on a cast without it, is a
        # config the user did not mean: say so instead of ignoring it
        for name, default, field, needs in _ONLY_WITH:
            if getattr(self, name) != default and getattr(self, field) is not needs:
                kind = f"{type(needs).__name__}.{needs.name}"
                raise ValueError(
                    f"CastConfig.{name}={getattr(self, name)!r} is only used with {kind}, but "
                    f"{field}={getattr(self, field).value!r}: set {field}={kind} or drop {name}"
                )
        if not self.option("float8_elements", True) and self.target_dtype is not None:
            raise ValueError(
                f"CastConfig.target_dtype={self.target_dtype} does not apply to scaling_granularity"
                f"={self.scaling_granularity.value!r} (no float8 elements): leave target_dtype=None"
            )

    def _split_granularity(self) -> None:
        """``scaling_granularity`` -> its member; its settings -> ``granularity_options``."""
        given, opts = self.scaling_granularity, self.granularity_options
        if isinstance(given, GranularitySettings):  # wins (dataclasses.replace passes both)
            given, opts = given.kind, given
        object.__setattr__(self, "scaling_granularity", given)
        _coerce_enum(self, "scaling_granularity", ScalingGranularity)
        kind = GRANULARITY_OPTIONS.get(self.scaling_granularity)
        if opts is None and kind is not None:
            opts = kind()
        if opts is not None and type(opts) is not kind:
            fix = f"pass {kind.__name__}(...) as scaling_granularity" if kind else "drop it"
            raise ValueError(
                f"CastConfig.granularity_options={opts!r} does not apply to scaling_granularity="
                f"{self.scaling_granularity.value!r}, which has no such settings: {fix}"
            )
        object.__setattr__(self, "granularity_options", opts)

    def __setstate__(self, state: dict) -> None:
        """Unpickle, also a CastConfig pickled by float8kit 0.4 (a checkpoint's FSDP2 weight
        carries its config), which kept its granularity's settings as four fields."""
        moved = {_MOVED_SETTINGS[k]: state.pop(k) for k in list(state) if k in _MOVED_SETTINGS}
        kind = GRANULARITY_OPTIONS.get(state["scaling_granularity"])
        if "granularity_options" not in state:
            ours = {f.name for f in dataclasses.fields(kind)} if kind else ()
            opts = {k: v for k, v in moved.items() if k in ours}
            state["granularity_options"] = kind(**opts) if kind else None
        self.__dict__.update(state)

    def option(self, name: str, default=False):
        """A setting (or a fact) of this cast's ``GranularitySettings``, ``default`` where it
        has none (how ``stochastic_rounding`` and ``hadamard`` read on a non-NVFP4 cast)."""
        return getattr(self.granularity_options, name, default)

    @property
    def enabled(self) -> bool:
        return self.scaling_type is not ScalingType.DISABLED

    def dtype_for(self, role: GemmRole) -> torch.dtype:
        """The float8 dtype this cast produces for an operand of ``role``."""
        if self.target_dtype is not None:
            return self.target_dtype
        if role is GemmRole.GRAD_OUTPUT and (
            self.scaling_granularity is ScalingGranularity.TENSORWISE
        ):
            return E5M2
        return E4M3

    def short(self, role: GemmRole) -> str:
        """Compact text for reprs, e.g. ``dyn_tensor_e4m3`` or ``hp``."""
        if not self.enabled:
            return "hp"
        dtype = "e4m3" if self.dtype_for(role) == E4M3 else "e5m2"
        opts = self.granularity_options
        gran = opts.short() if opts is not None else self.scaling_granularity.value[:-4]
        if not self.option("float8_elements", True):  # no float8 dtype to name
            return f"{self.scaling_type.value[:3]}_{gran}"
        return f"{self.scaling_type.value[:3]}_{gran}_{dtype}"


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Settings of one of the three gemms of a linear layer."""

    # accumulate in the tensor cores' faster, lower-precision mode (CUDA only; CPU ignores it,
    # and so do blockwise gemms, whose kernel promotes to fp32 every 128 products anyway)
    use_fast_accum: bool = False

    def __post_init__(self):
        _require_bools(self, "use_fast_accum")


def _kernel(cast: CastConfig) -> tuple | None:
    """The block-scaled kernel a cast's operands need (its granularity's), or None."""
    return None if cast.granularity_options is None else cast.granularity_options.kernel


def _blocks(cast: CastConfig) -> str:
    """The granularity of a cast, with its settings where it has them."""
    return repr(cast.granularity_options or cast.scaling_granularity.value)


@dataclasses.dataclass(frozen=True)
class Float8LinearConfig:
    """How a ``Float8Linear`` casts its operands and runs its three gemms.

    The three gemms are ``output = input @ weight.T``, ``grad_input = grad_output @ weight``
    and ``grad_weight = grad_output.T @ input``. Each operand is used by two gemms; the
    ``*_for_grad_*`` fields override the cast for its second use (None = same as the first),
    which is how ``rowwise_with_gw_hp`` keeps the grad_weight gemm in hp.
    """

    # input, as used by the output gemm
    cast_config_input: CastConfig = CastConfig()
    # input, as used by the grad_weight gemm (None = cast_config_input)
    cast_config_input_for_grad_weight: CastConfig | None = None
    # weight, as used by the output gemm
    cast_config_weight: CastConfig = CastConfig()
    # weight, as used by the grad_input gemm (None = cast_config_weight)
    cast_config_weight_for_grad_input: CastConfig | None = None
    # grad_output, as used by the grad_input gemm
    cast_config_grad_output: CastConfig = CastConfig()
    # grad_output, as used by the grad_weight gemm (None = cast_config_grad_output)
    cast_config_grad_output_for_grad_weight: CastConfig | None = None
    # per-gemm settings
    gemm_config_output: GemmConfig = GemmConfig(use_fast_accum=True)
    gemm_config_grad_input: GemmConfig = GemmConfig()
    gemm_config_grad_weight: GemmConfig = GemmConfig()
    # under FSDP2, cast weight shards to float8 before the all-gather (half the bytes of bf16)
    enable_fsdp_float8_all_gather: bool = False
    # run the float8 math in fp32 instead of torch._scaled_mm (debugging, unsupported devices)
    emulate: bool = False
    # zero-pad the gemms' inner dim to a multiple of 16 instead of raising on CUDA
    pad_inner_dim: bool = False
    # floor every scale to a power of two (exact rescaling; used by the rowwise recipes)
    round_scales_to_power_of_2: bool = False
    # DELAYED: warn when a layer runs this many train-mode forwards without precompute_scales
    # (raise it when accumulating gradients over more micro-batches; 0 = never warn)
    stale_delayed_warn_after: int = 16

    def __post_init__(self):
        for name in ("cast_config_input", "cast_config_weight", "cast_config_grad_output"):
            if not isinstance(getattr(self, name), CastConfig):
                raise ValueError(
                    f"Float8LinearConfig.{name}={getattr(self, name)!r} must be a CastConfig"
                )
        defaults = {
            "cast_config_input_for_grad_weight": self.cast_config_input,
            "cast_config_weight_for_grad_input": self.cast_config_weight,
            "cast_config_grad_output_for_grad_weight": self.cast_config_grad_output,
        }
        for name, default in defaults.items():
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            elif not isinstance(value, CastConfig):
                raise ValueError(
                    f"Float8LinearConfig.{name}={value!r} must be a CastConfig or None"
                )
        for name in ("gemm_config_output", "gemm_config_grad_input", "gemm_config_grad_weight"):
            if not isinstance(getattr(self, name), GemmConfig):
                raise ValueError(f"Float8LinearConfig.{name} must be a GemmConfig")
        bools = ("enable_fsdp_float8_all_gather", "emulate", "pad_inner_dim")
        _require_bools(self, *bools, "round_scales_to_power_of_2")
        _require_int(self, "stale_delayed_warn_after", 0, "0 disables the warning")
        # DELAYED/STATIC state is per operand (one history, one scale): both uses of an
        # operand that keep state must agree on how.
        for role, (first, second) in self.operand_uses().items():
            a, b = getattr(self, first), getattr(self, second)
            if a.scaling_type.stateful and b.scaling_type.stateful and a != b:
                raise ValueError(
                    f"Float8LinearConfig.{second}={b!r} differs from {first}={a!r}: an "
                    f"operand has one {a.scaling_type.value}/{b.scaling_type.value} scale "
                    f"state, so both of its uses must be the same CastConfig; set {second} "
                    "to None (same as the first) or to a DYNAMIC/DISABLED CastConfig"
                )
            for name, cast in ((first, a), (second, b)):
                if (
                    role is GemmRole.GRAD_OUTPUT
                    and cast.scaling_type is ScalingType.STATIC
                    and cast.static_scale is None
                ):
                    raise ValueError(
                        f"Float8LinearConfig.{name} is STATIC with static_scale=None: "
                        "calibrate() runs no backward, so a static grad_output needs "
                        "CastConfig(scaling_type=ScalingType.STATIC, static_scale=S)"
                    )
        # Both operands of a gemm are float8 or both hp: _scaled_mm takes no mixed pair.
        for gemm, (left, right) in self.gemm_operands().items():
            lcfg, rcfg = getattr(self, left), getattr(self, right)
            if lcfg.enabled != rcfg.enabled:
                raise ValueError(
                    f"Float8LinearConfig: the {gemm} gemm has {left} "
                    f"{'enabled' if lcfg.enabled else 'DISABLED'} but {right} "
                    f"{'enabled' if rcfg.enabled else 'DISABLED'}; set both to "
                    "ScalingType.DISABLED or neither"
                )
            # A block-scaled kernel (MX, NVFP4, blockwise) multiplies operands of its own
            # blocks only, with one block along the inner dim K.
            if lcfg.enabled and _kernel(lcfg) != _kernel(rcfg):
                opts = lcfg.granularity_options or rcfg.granularity_options
                raise ValueError(
                    f"Float8LinearConfig: the {gemm} gemm has {left} {_blocks(lcfg)} but "
                    f"{right} {_blocks(rcfg)}; {opts.pairing}, or neither"
                )
            if lcfg.enabled and lcfg.granularity_options is not None:
                lcfg.granularity_options.check_gemm(gemm, (left, lcfg), (right, rcfg))
        for role, pair in self.operand_uses().items():
            for name in pair:
                if getattr(self, name).granularity_options is not None:
                    getattr(self, name).granularity_options.check_use(name, role)
        if not any(
            getattr(self, name).enabled for pair in self.operand_uses().values() for name in pair
        ):
            raise ValueError(
                "Float8LinearConfig: every cast is ScalingType.DISABLED, so no gemm would run "
                "in float8: keep such layers nn.Linear (module_filter_fn returning False)"
            )
        roles = {name: role for role, pair in self.operand_uses().items() for name in pair}
        for gemm, (left, right) in self.gemm_operands().items():
            lcfg, rcfg = getattr(self, left), getattr(self, right)
            if lcfg.enabled and lcfg.dtype_for(roles[left]) == rcfg.dtype_for(roles[right]) == E5M2:
                raise ValueError(
                    f"Float8LinearConfig: the {gemm} gemm would multiply e5m2 by e5m2 ({left} and "
                    f"{right}), which float8 gemm kernels do not take: make one of them e4m3 "
                    "(CastConfig.target_dtype=torch.float8_e4m3fn, or None for the role's default)"
                )
        if self.enable_fsdp_float8_all_gather:
            self._check_fsdp_float8_all_gather()

    def _check_fsdp_float8_all_gather(self) -> None:
        """The weights FSDP2 can gather in float8 (float8kit/distributed/fsdp.py): one cast
        is gathered, the one the output gemm uses; the grad_input gemm uses it as is (the
        same tensorwise or blockwise cast) or re-casts it locally (axiswise forward cast),
        which is exact only when both scales are powers of two. MX weights gather each gemm's
        own cast, one per pass (float8kit/formats/mx.py), so both casts must be MX."""
        w, gi = self.cast_config_weight, self.cast_config_weight_for_grad_input
        if not w.enabled:
            raise ValueError(
                "Float8LinearConfig.enable_fsdp_float8_all_gather=True needs a float8 weight, "
                "but cast_config_weight is DISABLED: set enable_fsdp_float8_all_gather=False"
            )
        per_pass = (c.scaling_granularity for c in (w, gi) if c.option("gathers_per_pass"))
        if (kind := next(per_pass, None)) is not None:  # (MX) a cast along K, one along N
            if not (gi.enabled and w.scaling_granularity is gi.scaling_granularity):
                raise ValueError(
                    f"Float8LinearConfig.enable_fsdp_float8_all_gather=True with a {kind.value} "
                    "weight gathers the cast each gemm needs (along K in forward, along N in "
                    "backward), so cast_config_weight and cast_config_weight_for_grad_input "
                    f"must both be ScalingGranularity.{kind.name} (got "
                    f"{w.scaling_granularity.value} and {gi.scaling_granularity.value}): make "
                    f"both {kind.value} (its recipe), or set enable_fsdp_float8_all_gather=False"
                )
            wd, gd = w.dtype_for(GemmRole.WEIGHT), gi.dtype_for(GemmRole.WEIGHT)
            if wd != gd:  # both copies come through FSDP2's one buffer, of one float8 dtype
                raise ValueError(
                    "Float8LinearConfig.enable_fsdp_float8_all_gather=True with MX weights "
                    "gathers both copies into one float8 buffer, so the float8 dtype of "
                    f"cast_config_weight_for_grad_input ({gd}) must equal cast_config_weight's "
                    f"({wd}): give them one target_dtype, or set "
                    "enable_fsdp_float8_all_gather=False"
                )
            return
        if w.scaling_granularity is not ScalingGranularity.AXISWISE:
            if gi != w:
                raise ValueError(
                    "Float8LinearConfig.enable_fsdp_float8_all_gather=True with a tensorwise, "
                    "blockwise or NVFP4 weight gathers one float8 weight for both gemms, so "
                    "cast_config_weight_for_grad_input must equal cast_config_weight (or be None)"
                )
            return
        # Axiswise (rowwise): the gathered row-scaled weight is re-cast for grad_input.
        if not gi.enabled or gi.scaling_type is not ScalingType.DYNAMIC:
            raise ValueError(
                "Float8LinearConfig.enable_fsdp_float8_all_gather=True with an axiswise "
                "cast_config_weight re-casts the gathered row-scaled weight for the grad_input "
                f"gemm, which needs a DYNAMIC cast_config_weight_for_grad_input (got "
                f"{gi.scaling_type.value!r}): use a DYNAMIC tensorwise or axiswise cast there"
            )
        if not self.round_scales_to_power_of_2:
            raise ValueError(
                "Float8LinearConfig.enable_fsdp_float8_all_gather=True with an axiswise "
                "cast_config_weight needs round_scales_to_power_of_2=True: the grad_input gemm "
                "re-casts the gathered row-scaled float8 weight, which is exact (a shift of "
                "the exponent) only between power-of-2 scales (about 27 dB SQNR otherwise); "
                "set round_scales_to_power_of_2=True (the rowwise recipes do) or "
                "enable_fsdp_float8_all_gather=False"
            )

    def with_hp_forward(self) -> Float8LinearConfig:
        """This config with the output gemm in hp (the NVFP4 paper's switch of the forward
        gemms to bf16 late in training): input and weight keep their casts for the backward
        gemms (grad_weight, grad_input). Raises for DELAYED/STATIC casts, whose scale state
        the forward gemm records."""
        for name in ("cast_config_input", "cast_config_weight"):
            if getattr(self, name).scaling_type.stateful:
                raise ValueError(
                    f"Float8LinearConfig.with_hp_forward(): {name} is "
                    f"{getattr(self, name).scaling_type.value}, whose scale state the forward "
                    "gemm keeps; an hp forward is for DYNAMIC recipes (nvfp4, mxfp8, tensorwise, "
                    "rowwise, blockwise)"
                )
        off = CastConfig(scaling_type=ScalingType.DISABLED)
        return dataclasses.replace(
            self,
            cast_config_input=off,
            cast_config_input_for_grad_weight=self.cast_config_input_for_grad_weight,
            cast_config_weight=off,
            cast_config_weight_for_grad_input=self.cast_config_weight_for_grad_input,
            enable_fsdp_float8_all_gather=False,
        )

    @staticmethod
    def operand_uses() -> dict[GemmRole, tuple[str, str]]:
        """operand role -> (its cast field in the first gemm, in the second gemm)."""
        return OPERAND_USES

    def stateful_cast(self, role: GemmRole) -> CastConfig | None:
        """The DELAYED or STATIC cast of operand ``role`` (its uses agree), or None."""
        for name in self.operand_uses()[role]:
            cast = getattr(self, name)
            if cast.scaling_type.stateful:
                return cast
        return None

    @staticmethod
    def gemm_operands() -> dict[str, tuple[str, str]]:
        """gemm name -> (left operand's cast field, right operand's cast field)."""
        return {g.name: (g.left.cast_field, g.right.cast_field) for g in GEMMS}

    @staticmethod
    def from_recipe_name(name: str | Float8Recipe) -> Float8LinearConfig:
        """A named preset: ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``, ``delayed``,
        ``blockwise``, ``mxfp8`` or ``nvfp4`` (or another library's enum of these names,
        torchao's ``Float8LinearRecipeName``: by value)."""
        name = _recipe_value(name)
        if isinstance(name, str):
            try:
                name = Float8Recipe(name)
            except ValueError:
                valid = ", ".join(repr(r.value) for r in Float8Recipe)
                raise ValueError(f"unknown float8 recipe {name!r}: use one of {valid}") from None
        return _RECIPES[name]()


WGRAD_OPERANDS = ("hp", "dequantized")


@dataclasses.dataclass(frozen=True)
class Float8ExpertsConfig:
    """How ``convert_experts_to_float8_training`` runs MoE expert weights' grouped gemms.

    Composes the cast and gemm settings of a linear layer: ``cast_config`` casts every operand
    of the three grouped gemms, DYNAMIC e4m3 in one of torch's two float8 grouped kernels:
    AXISWISE (scales per token and per expert column in the output and grad_input gemms, per
    expert group in the weight-gradient gemm) or MX (MXFP8, Blackwell: one e8m0 scale per 32
    elements along each gemm's inner dim; token groups padded to 32 rows for the
    weight-gradient gemm, whose blocks run along tokens). ``gemm_config_output`` sets the
    output gemm. ``wgrad_with_hp`` runs the weight-gradient gemm in hp instead. Named presets:
    ``from_recipe_name("rowwise")`` (the default), ``"mxfp8"`` and ``"mxfp8_wgrad_with_hp"``.
    """

    # the cast of every grouped-gemm operand (DYNAMIC, e4m3, AXISWISE or MX)
    cast_config: CastConfig = CastConfig(
        scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3
    )
    # the output gemm (fast accumulation on CUDA); the backward gemms run without it
    gemm_config_output: GemmConfig = GemmConfig()
    # floor every scale to a power of two (exact rescaling, as the rowwise linear recipe;
    # AXISWISE only: MX scales are powers of two by definition)
    round_scales_to_power_of_2: bool = True
    # run the float8 math in fp32 instead of torch._scaled_grouped_mm (CPU always does:
    # torch has no CPU kernel)
    emulate: bool = False
    # under FSDP2, cast expert weight shards to float8 before the all-gather (rowwise scales
    # per expert are local to the shard; the expert count must divide by the world size)
    enable_fsdp_float8_all_gather: bool = False
    # how the expert weights are stored, which says along which dim the float8 all-gather
    # scales them (the dim the output gemm reduces): None (default) = decided per weight at
    # its first use (exact from the first step); "in_out" = (experts, in, out), used as
    # torch._grouped_mm(x, w) (GPT-OSS); "out_in" = (experts, out, in), used as
    # torch._grouped_mm(x, w.transpose(-2, -1)) (most Hugging Face MoE models, torchtitan).
    # Only the float8 all-gather reads it; a gathered weight used the other way than set raises.
    weight_layout: str | None = None
    # what the weight-gradient gemm casts along the tokens: "hp" (default) the saved hp input
    # and grad_output; "dequantized" the values of the row casts the output and grad_input
    # gemms used (exact for power-of-two scales), the only values an expert-parallel rank has
    # for tokens dispatched in float8 (float8kit.expert_parallel): with it, one rank computes
    # exactly what expert parallelism computes, and saves float8 rows instead of hp ones
    wgrad_operands: str = "hp"
    # run the weight-gradient gemm in hp (torch._grouped_mm of those operands, torchao's
    # wgrad_with_hp): the gemm whose sums run along the tokens, where a float8 cast loses the
    # most; the output and grad_input gemms stay float8
    wgrad_with_hp: bool = False

    @staticmethod
    def from_recipe_name(name: str | Float8Recipe) -> Float8ExpertsConfig:
        """A named preset: ``rowwise`` (the default config), ``mxfp8`` (MX e4m3 operands,
        RCEIL scales, no fast accumulation: the MX kernel has none) or
        ``mxfp8_wgrad_with_hp`` (mxfp8 with the weight-gradient gemm in hp). torchao's
        ``MXFP8TrainingRecipe`` names of the last two (``mxfp8_rceil``,
        ``mxfp8_rceil_wgrad_with_hp``) and its enum members are taken too."""
        value = name.value if isinstance(name, enum.Enum) else name
        value = _TORCHAO_EXPERTS_RECIPES.get(value, value)
        if value not in _EXPERTS_RECIPES:
            valid = ", ".join(repr(r) for r in _EXPERTS_RECIPES)
            raise ValueError(f"unknown Float8ExpertsConfig recipe {value!r}: use one of {valid}")
        return _EXPERTS_RECIPES[value]()

    def __post_init__(self):
        c = self.cast_config
        if not isinstance(c, CastConfig) or (
            c.scaling_type is not ScalingType.DYNAMIC
            or c.scaling_granularity not in (ScalingGranularity.AXISWISE, ScalingGranularity.MX)
            or c.dtype_for(GemmRole.INPUT) != E4M3
        ):
            raise ValueError(
                f"Float8ExpertsConfig.cast_config={c!r} is not supported: the float8 grouped "
                "gemms take DYNAMIC e4m3 operands, AXISWISE or MX; use CastConfig("
                "scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3), the "
                'default, or Float8ExpertsConfig.from_recipe_name("mxfp8")'
            )
        if self.wgrad_operands not in WGRAD_OPERANDS:
            raise ValueError(
                f"Float8ExpertsConfig.wgrad_operands={self.wgrad_operands!r}: use one of "
                f"{WGRAD_OPERANDS}"
            )
        if self.wgrad_operands == "dequantized" and not (
            c.option("power_of_2_scales") or self.round_scales_to_power_of_2
        ):
            raise ValueError(
                'Float8ExpertsConfig.wgrad_operands="dequantized" needs power-of-two row '
                "scales (exact dequantization): set round_scales_to_power_of_2=True"
            )
        if self.enable_fsdp_float8_all_gather and (
            c.scaling_granularity is not ScalingGranularity.AXISWISE
        ):  # the experts' float8 all-gather sends each expert's rowwise cast
            raise ValueError(
                "Float8ExpertsConfig.enable_fsdp_float8_all_gather=True is not supported with "
                f"a {c.scaling_granularity.value} cast_config yet (axiswise only): set "
                "enable_fsdp_float8_all_gather=False (FSDP2 gathers the hp expert weights, "
                "each gemm casts them)"
            )
        if not isinstance(self.gemm_config_output, GemmConfig):
            raise ValueError(
                f"Float8ExpertsConfig.gemm_config_output={self.gemm_config_output!r} must be a "
                "GemmConfig"
            )
        if not c.option("fast_accum", True) and self.gemm_config_output.use_fast_accum:
            raise ValueError(
                "Float8ExpertsConfig.gemm_config_output.use_fast_accum=True does not apply to "
                f"{c.scaling_granularity.value}: its kernel (MX: every 32 products scaled in "
                "fp32) has no fast accumulation; use gemm_config_output=GemmConfig()"
            )
        if self.weight_layout not in (None, "in_out", "out_in"):
            raise ValueError(
                f"Float8ExpertsConfig.weight_layout={self.weight_layout!r} must be None "
                '(decided at the first use, the default), "in_out" (experts, in, out) or '
                '"out_in" (experts, out, in)'
            )
        bools = ("round_scales_to_power_of_2", "emulate", "enable_fsdp_float8_all_gather")
        _require_bools(self, *bools, "wgrad_with_hp")


@dataclasses.dataclass(frozen=True)
class Float8ReduceScatterConfig:
    """How ``enable_float8_reduce_scatter`` sends FSDP2's gradient reduce-scatter (qgZ).

    Each rank's reduce-scatter input is cut into blocks of ``cast_config.block_size``
    elements along the flattened gradient (1 x block_size tiles); every block gets its own
    scale (``fp8 = saturate(hp * scale)``) and travels as float8 bytes plus one fp32 scale in
    a single all-to-all. The receiving rank dequantizes and sums in fp32.
    """

    def __new__(cls, *args, **kwargs):
        old = {"dtype": "cast_config's target_dtype", "block_size": "cast_config's block size"}
        for field, now in old.items():
            if field in kwargs:
                raise TypeError(
                    f"Float8ReduceScatterConfig({field}=...) is 0.3's: it is now {now}: "
                    "Float8ReduceScatterConfig(cast_config=CastConfig(scaling_granularity="
                    "BlockwiseGranularity(block_size=...), target_dtype=...))"
                )
        return super().__new__(cls)

    # the cast of the sent gradient: DYNAMIC BLOCKWISE, its float8 format (target_dtype: e4m3
    # by default, more mantissa; blocks cover the range) and block_size (elements per fp32
    # scale: 4 / block_size bytes each)
    cast_config: CastConfig = CastConfig(
        scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E4M3
    )
    # floor every block scale to a power of two (exact rescaling)
    round_scales_to_power_of_2: bool = False

    def __post_init__(self):
        c = self.cast_config
        if not isinstance(c, CastConfig) or (
            c.scaling_type is not ScalingType.DYNAMIC
            or c.scaling_granularity is not ScalingGranularity.BLOCKWISE
        ):
            raise ValueError(
                f"Float8ReduceScatterConfig.cast_config={c!r} is not supported: gradient "
                "blocks are cast DYNAMIC BLOCKWISE; use CastConfig(scaling_granularity="
                "BlockwiseGranularity(block_size=...), target_dtype=...)"
            )
        _require_bools(self, "round_scales_to_power_of_2")

    @property
    def dtype(self) -> torch.dtype:
        """The float8 format sent (``cast_config``'s; e4m3 by default)."""
        return self.cast_config.dtype_for(GemmRole.GRAD_OUTPUT)

    @property
    def block_size(self) -> int:
        """Elements per scale along the flattened gradient."""
        return self.cast_config.granularity_options.block_size


def _recipe_value(name):
    """A recipe name as float8kit's: another library's enum member by its value."""
    if isinstance(name, enum.Enum) and not isinstance(name, Float8Recipe):
        return name.value
    return name


def config_name(config: object) -> str:
    """``config``'s type as an error names it: with its module where it is not float8kit's
    (torchao.float8's ``Float8LinearConfig`` has float8kit's name)."""
    kind = type(config)
    if kind.__module__.startswith("float8kit"):
        return kind.__name__
    return f"{kind.__module__}.{kind.__qualname__} (build float8kit's own config)"


class Float8Recipe(enum.Enum):
    """Named presets for ``Float8LinearConfig.from_recipe_name``."""

    TENSORWISE = "tensorwise"  # dynamic tensorwise everywhere: fastest, the torchao default
    ROWWISE = "rowwise"  # dynamic rowwise, e4m3 everywhere, power-of-2 scales: more accurate
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"  # rowwise, but the grad_weight gemm in hp
    DELAYED = "delayed"  # tensorwise delayed scaling everywhere (call precompute_scales)
    BLOCKWISE = "blockwise"  # DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks
    MXFP8 = "mxfp8"  # OCP MXFP8 (Blackwell): e4m3, one e8m0 scale per 32 along each gemm's K
    # NVIDIA's NVFP4 training recipe (Blackwell): e2m1 + e4m3 per 16 + fp32 per tensor; 16x16
    # weight blocks, stochastic rounding of gradients, Hadamard transform in grad_weight
    NVFP4 = "nvfp4"


def _every_operand(cast: CastConfig, **settings) -> Float8LinearConfig:
    """A config that casts input, weight and grad_output (both uses of each) with ``cast``."""
    operands = ("input", "weight", "grad_output")
    return Float8LinearConfig(**{f"cast_config_{o}": cast for o in operands}, **settings)


def _rowwise() -> Float8LinearConfig:
    axis = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3)
    return _every_operand(axis, round_scales_to_power_of_2=True)


def _rowwise_with_gw_hp() -> Float8LinearConfig:
    # grad_weight accumulates over the token dim, where rowwise scales fit worst and where
    # precision matters most for the optimizer; keep that gemm in hp. The weight's second
    # use (grad_input) is scaled tensorwise so it needs no second rowwise pass.
    axis = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3)
    hp = CastConfig(scaling_type=ScalingType.DISABLED)
    return Float8LinearConfig(
        cast_config_input=axis,
        cast_config_input_for_grad_weight=hp,
        cast_config_weight=axis,
        cast_config_weight_for_grad_input=CastConfig(target_dtype=E4M3),
        cast_config_grad_output=axis,
        cast_config_grad_output_for_grad_weight=hp,
        round_scales_to_power_of_2=True,
    )


def _delayed() -> Float8LinearConfig:
    return _every_operand(CastConfig(scaling_type=ScalingType.DELAYED))


def _blockwise() -> Float8LinearConfig:
    # One 128x128 weight cast serves the output and grad_input gemms (a block is its own
    # transpose); input and grad_output are cast in 1x128 tiles along each gemm's inner
    # dim. Block-scaled kernels promote to fp32 every 128 products, so fast accumulation
    # has nothing to trade: all gemms run without it.
    block = CastConfig(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E4M3)
    return _every_operand(block, gemm_config_output=GemmConfig())


def _mxfp8() -> Float8LinearConfig:
    # Every operand of every gemm is cast from hp along the dim that gemm reduces (an MX
    # block is not its own transpose), e4m3 everywhere, RCEIL scales. The MX kernel scales
    # every 32 products in its accumulator: there is no fast-accumulation mode to choose.
    mx = CastConfig(scaling_granularity=ScalingGranularity.MX, target_dtype=E4M3)
    return _every_operand(mx, gemm_config_output=GemmConfig())


def nvfp4_config(*, hadamard: bool = True, stochastic_rounding: bool = True) -> Float8LinearConfig:
    """NVIDIA's NVFP4 pretraining recipe (``from_recipe_name("nvfp4")`` is the default call),
    with its two gradient-side parts switchable for ablations: every gemm in NVFP4 (two-level
    scales); the weight in 16x16 blocks (one cast serves the output and grad_input gemms),
    activations and gradients in 1x16 blocks along each gemm's inner dim; ``hadamard``: the
    grad_weight gemm's two operands Hadamard-transformed along the tokens;
    ``stochastic_rounding``: gradients (grad_output, in both of its gemms) rounded
    stochastically. The recipe's third part, the last ~15% of layers in hp, is a module
    filter: ``float8kit.hp_tail_filter``."""

    def fp4(**settings) -> CastConfig:
        return CastConfig(scaling_granularity=NVFP4Granularity(**settings))

    sr = stochastic_rounding
    return Float8LinearConfig(
        cast_config_input=fp4(),
        cast_config_input_for_grad_weight=fp4(hadamard=hadamard),
        cast_config_weight=fp4(),
        cast_config_grad_output=fp4(stochastic_rounding=sr),
        cast_config_grad_output_for_grad_weight=fp4(stochastic_rounding=sr, hadamard=hadamard),
        gemm_config_output=GemmConfig(),
    )


def _experts_mxfp8(wgrad_with_hp: bool = False) -> Float8ExpertsConfig:
    # every operand of the float8 grouped gemms cast from hp along the dim its gemm reduces
    mx = CastConfig(scaling_granularity=ScalingGranularity.MX, target_dtype=E4M3)
    return Float8ExpertsConfig(
        cast_config=mx, gemm_config_output=GemmConfig(), wgrad_with_hp=wgrad_with_hp
    )


_EXPERTS_RECIPES = {
    "rowwise": Float8ExpertsConfig,
    "mxfp8": _experts_mxfp8,
    "mxfp8_wgrad_with_hp": functools.partial(_experts_mxfp8, wgrad_with_hp=True),
}
# torchao.prototype.moe_training's MXFP8TrainingRecipe values (its emulated one is a kernel
# choice, ``emulate``, not a recipe here)
_TORCHAO_EXPERTS_RECIPES = {
    "mxfp8_rceil": "mxfp8",
    "mxfp8_rceil_wgrad_with_hp": "mxfp8_wgrad_with_hp",
}


_RECIPES = {
    Float8Recipe.TENSORWISE: Float8LinearConfig,
    Float8Recipe.ROWWISE: _rowwise,
    Float8Recipe.ROWWISE_WITH_GW_HP: _rowwise_with_gw_hp,
    Float8Recipe.DELAYED: _delayed,
    Float8Recipe.BLOCKWISE: _blockwise,
    Float8Recipe.MXFP8: _mxfp8,
    Float8Recipe.NVFP4: nvfp4_config,
}
