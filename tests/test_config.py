from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

import compile_runtime as cr
from compile_runtime.config import CudagraphModeError, FrozenConfigError, parse_config
from compile_runtime.planner.capture_sizes import resolve_capture_sizes
from compile_runtime.planner.sizes import default_capture_sizes

M = cr.CUDAGraphMode
S = cr.AttentionCGSupport
NONE, PW, FULL, FDO, FAP = M.NONE, M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE

# (requested mode, attention split) -> {support: (result for query len 1, for query len 2)}
# Written out by hand from the mode rules, not computed by the code under test.
RESOLUTION_TABLE = {
    (NONE, True): {
        S.ALWAYS: (NONE, NONE),
        S.UNIFORM_BATCH: (NONE, NONE),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (NONE, NONE),
        S.NEVER: (NONE, NONE),
    },
    (NONE, False): {
        S.ALWAYS: (NONE, NONE),
        S.UNIFORM_BATCH: (NONE, NONE),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (NONE, NONE),
        S.NEVER: (NONE, NONE),
    },
    (PW, True): {
        S.ALWAYS: (PW, PW),
        S.UNIFORM_BATCH: (PW, PW),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (PW, PW),
        S.NEVER: (PW, PW),
    },
    (PW, False): {
        S.ALWAYS: (NONE, NONE),
        S.UNIFORM_BATCH: (NONE, NONE),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (NONE, NONE),
        S.NEVER: (NONE, NONE),
    },
    (FULL, True): {
        S.ALWAYS: (FULL, FULL),
        S.UNIFORM_BATCH: (FAP, FAP),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (FAP, PW),
        S.NEVER: (PW, PW),
    },
    (FULL, False): {
        S.ALWAYS: (FULL, FULL),
        S.UNIFORM_BATCH: (FDO, FDO),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (FDO, NONE),
        S.NEVER: (NONE, NONE),
    },
    (FDO, True): {
        S.ALWAYS: (FDO, FDO),
        S.UNIFORM_BATCH: (FDO, FDO),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (FDO, PW),
        S.NEVER: (PW, PW),
    },
    (FDO, False): {
        S.ALWAYS: (FDO, FDO),
        S.UNIFORM_BATCH: (FDO, FDO),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (FDO, NONE),
        S.NEVER: (NONE, NONE),
    },
    (FAP, True): {
        S.ALWAYS: (FAP, FAP),
        S.UNIFORM_BATCH: (FAP, FAP),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (FAP, PW),
        S.NEVER: (PW, PW),
    },
    (FAP, False): {
        S.ALWAYS: (FULL, FULL),
        S.UNIFORM_BATCH: (FDO, FDO),
        S.UNIFORM_SINGLE_TOKEN_DECODE: (FDO, NONE),
        S.NEVER: (NONE, NONE),
    },
}


def as_default(config: cr.CompilationConfig) -> cr.CompilationConfig:
    """The same values, as if cudagraph_mode had been left at its default."""
    return cr.CompilationConfig.model_construct(_fields_set=set(), **dict(config))


CASES = [
    (mode, split, support, qlen, expected[qlen - 1])
    for (mode, split), row in RESOLUTION_TABLE.items()
    for support, expected in row.items()
    for qlen in (1, 2)
]


def test_table_covers_every_combination():
    assert len(CASES) == len(M) * 2 * len(S) * 2


@pytest.mark.parametrize("mode,split,support,qlen,expected", CASES)
def test_resolution_table(mode, split, support, qlen, expected):
    config = cr.CompilationConfig(cudagraph_mode=mode.name, splitting_ops=None if split else [])
    # Defaults (not set explicitly) downgrade silently to what can run.
    config_default = as_default(config)
    resolved = config_default.resolve(support, uniform_decode_query_len=qlen, cuda_available=True)
    assert resolved.cudagraph_mode == expected
    assert resolved.decode_mode in expected.valid_runtime_modes()
    assert resolved.mixed_mode in expected.valid_runtime_modes()
    assert resolved.decode_mode.is_runtime_mode() and resolved.mixed_mode.is_runtime_mode()
    # An explicit request for graphs that ends with none is an error naming the fix.
    if mode != NONE and expected == NONE:
        with pytest.raises(CudagraphModeError, match="cudagraph_mode='NONE'"):
            config.resolve(support, uniform_decode_query_len=qlen, cuda_available=True)
    else:
        assert (
            config.resolve(support, uniform_decode_query_len=qlen, cuda_available=True) == resolved
        )


def test_downgrade_logs_one_line_each(caplog):
    config = cr.CompilationConfig(cudagraph_mode="FULL")
    with caplog.at_level(logging.INFO, logger="compile_runtime.config"):
        config.resolve(S.NEVER, cuda_available=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "cudagraph_mode FULL -> FULL_AND_PIECEWISE: FULL graphs of mixed batches need attention "
        "support ALWAYS, have NEVER",
        "cudagraph_mode FULL_AND_PIECEWISE -> PIECEWISE: FULL graphs of decode batches (query "
        "length 1) need attention support UNIFORM_SINGLE_TOKEN_DECODE, have NEVER",
    ]


def test_no_cuda_resolves_to_none_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="compile_runtime.config"):
        resolved = cr.CompilationConfig(cudagraph_mode="FULL").resolve(
            S.ALWAYS, cuda_available=False
        )
    assert resolved.cudagraph_mode == NONE
    assert "CUDA is not available" in caplog.text


@pytest.mark.parametrize("compile_mode", ["NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE"])
def test_piecewise_graphs_need_piecewise_compilation(compile_mode):
    config = as_default(
        cr.CompilationConfig(mode=compile_mode, cudagraph_mode="FULL_AND_PIECEWISE")
    )
    assert config.resolve(S.ALWAYS, cuda_available=True).cudagraph_mode == FULL
    assert config.resolve(S.UNIFORM_BATCH, cuda_available=True).cudagraph_mode == FDO
    assert config.resolve(S.NEVER, cuda_available=True).cudagraph_mode == NONE
    explicit = cr.CompilationConfig(mode=compile_mode, cudagraph_mode="PIECEWISE")
    with pytest.raises(CudagraphModeError, match="CompilationMode.PIECEWISE"):
        explicit.resolve(S.NEVER, cuda_available=True)


def test_mode_helpers():
    assert FAP.decode_mode() == FULL and FAP.mixed_mode() == PW and FAP.separate_routine()
    assert FDO.decode_mode() == FULL and FDO.mixed_mode() == NONE
    assert FULL.decode_mode() == FULL and not FULL.separate_routine()
    assert FAP.has_full_cudagraphs() and FAP.has_piecewise_cudagraphs()
    assert FDO.has_full_cudagraphs() and not FDO.has_piecewise_cudagraphs()
    assert PW.requires_piecewise_compilation() and not FULL.requires_piecewise_compilation()
    assert FAP.valid_runtime_modes() == {NONE, FULL, PW}
    assert M.from_parts(FULL, PW) == FAP and M.from_parts(PW, PW) == PW
    with pytest.raises(ValueError, match="decode=PIECEWISE and mixed=FULL"):
        M.from_parts(PW, FULL)
    assert S.NEVER < S.UNIFORM_SINGLE_TOKEN_DECODE < S.UNIFORM_BATCH < S.ALWAYS


def test_defaults():
    config = cr.CompilationConfig()
    assert config.mode == cr.CompilationMode.PIECEWISE
    assert config.backend == "inductor"
    assert config.cudagraph_mode == FAP
    sizes = resolve_capture_sizes(config)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512
    assert 248 in sizes and 256 in sizes and 272 in sizes and 264 not in sizes
    assert resolve_capture_sizes(config, max_num_tokens=100)[-1] == 96
    assert resolve_capture_sizes(cr.CompilationConfig(max_cudagraph_capture_size=20)) == [
        1,
        2,
        4,
        8,
        16,
    ]


@given(st.lists(st.integers(min_value=-5, max_value=1000), max_size=20))
def test_capture_sizes_normalise_or_name_bad_value(sizes):
    try:
        config = cr.CompilationConfig(cudagraph_capture_sizes=sizes)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        bad = [s for s in sizes if s <= 0]
        assert bad and str(bad[0]) in str(e)
        return
    assert all(s > 0 for s in sizes)
    assert config.cudagraph_capture_sizes == sorted(set(sizes))
    assert resolve_capture_sizes(config) == sorted(set(sizes))


@given(
    st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=10), st.integers(1, 600)
)
def test_capture_sizes_and_contradicting_max(sizes, max_size):
    if max(sizes) == max_size:
        assert cr.CompilationConfig(
            cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=max_size
        )
    else:
        with pytest.raises(ValueError, match=str(max(sizes))):
            cr.CompilationConfig(cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=max_size)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"not_a_field": 1}, "not_a_field"),
        ({"mode": "FAST"}, "mode"),
        ({"cudagraph_mode": "HALF"}, "cudagraph_mode"),
        ({"compile_sizes": [4, -1]}, "compile_sizes"),
        ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size"),
        ({"backend": "tvm"}, "backend"),
        ({"pass_config": {"enable_magic": True}}, "enable_magic"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        cr.CompilationConfig(**kwargs)


def test_enums_by_name_and_round_trip():
    config = parse_config('{"mode": "DYNAMO_TRACE_ONCE", "cudagraph_mode": "full_decode_only"}')
    assert config.mode == cr.CompilationMode.DYNAMO_TRACE_ONCE and config.cudagraph_mode == FDO
    again = cr.CompilationConfig.model_validate(json.loads(config.to_json()))
    assert again == config
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_config("{mode: ")


def test_compute_hash_is_stable():
    base = cr.CompilationConfig()
    assert base.compute_hash() == cr.CompilationConfig().compute_hash()
    assert base.compute_hash() == parse_config(base.to_json()).compute_hash()


# One valid value per CompilationConfig field, different from its default. A new field
# fails test_every_field_is_hashed_unless_listed until it gets a mutation here.
FIELD_MUTATIONS = {
    "mode": "DYNAMO_TRACE_ONCE",
    "backend": "eager",
    "splitting_ops": [],
    "compile_sizes": [8],
    "cudagraph_mode": "PIECEWISE",
    "cudagraph_capture_sizes": [1, 2, 4],
    "max_cudagraph_capture_size": 64,
    "cudagraph_num_warmups": 3,
    "lazy_capture": False,
    "cache_dir": "/elsewhere",
    "disable_cache": True,
    "pass_config": {"enable_fusion": False},  # every flag: test_passes.py
    "inductor_compile_config": {"max_autotune": True},
    "dedupe_pieces": False,
    "debug_dump_path": "/tmp/x",
}


@pytest.mark.parametrize("name", sorted(cr.CompilationConfig.model_fields))
def test_every_field_is_hashed_unless_listed(name):
    """A field that changes compiled code must change the cache key; a listed one must not."""
    assert name in FIELD_MUTATIONS, f"add a valid non-default value for {name} to FIELD_MUTATIONS"
    base = cr.CompilationConfig()
    changed = cr.CompilationConfig(**{name: FIELD_MUTATIONS[name]})
    assert getattr(changed, name) != getattr(base, name)  # the mutation really changes the field
    if name in cr.CompilationConfig.HASH_EXCLUDED_FIELDS:
        assert changed.compute_hash() == base.compute_hash()
    else:
        assert changed.compute_hash() != base.compute_hash()


def test_hash_excluded_fields_and_mutations_name_real_fields():
    fields = set(cr.CompilationConfig.model_fields)
    assert cr.CompilationConfig.HASH_EXCLUDED_FIELDS <= fields
    assert set(FIELD_MUTATIONS) == fields


def test_set_compilation_config_nests():
    outer, inner = cr.CompilationConfig(backend="eager"), cr.CompilationConfig(mode="NONE")
    assert cr.get_compilation_config() == cr.CompilationConfig()
    with cr.set_compilation_config(outer):
        assert cr.get_compilation_config() is outer
        with cr.set_compilation_config(inner):
            assert cr.get_compilation_config() is inner
        assert cr.get_compilation_config() is outer
    with pytest.raises(TypeError, match="CompilationConfig"):
        with cr.set_compilation_config({"mode": "NONE"}):
            pass


def test_default_ladder():
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(3) == [1, 2]


def test_compilation_config_is_frozen():
    """Assigning a field raises, naming the field and ``replace``; nothing drifts after build."""
    config = cr.CompilationConfig(cudagraph_mode="PIECEWISE", compile_sizes=[4, 2])
    with pytest.raises(FrozenConfigError, match=r"CompilationConfig\.mode=.*replace\(mode="):
        config.mode = cr.CompilationMode.NONE
    with pytest.raises(AttributeError, match=r"pass_config=\{'enable_fusion'"):
        config.pass_config.enable_fusion = False
    with pytest.raises(AttributeError, match="cache_dir"):
        del config.cache_dir
    assert config.mode == cr.CompilationMode.PIECEWISE and config.pass_config.enable_fusion
    assert hash(config) == hash(
        cr.CompilationConfig(cudagraph_mode="PIECEWISE", compile_sizes=[2, 4])
    )
    assert {config: 1}[config.replace()] == 1


def test_replace_validates_and_keeps_what_was_set():
    config = cr.CompilationConfig(cudagraph_mode="PIECEWISE")
    changed = config.replace(backend="eager", compile_sizes=[8, 2, 8])
    assert (changed.backend, changed.compile_sizes, config.backend) == ("eager", [2, 8], "inductor")
    # resolve() tells an explicit cudagraph_mode from the default: replace keeps it explicit
    assert changed.model_fields_set == {"cudagraph_mode", "backend", "compile_sizes"}
    assert "cudagraph_mode" not in cr.CompilationConfig().replace(backend="eager").model_fields_set
    for bad in ({"compile_sizes": [-1]}, {"max_cudagraph_capture_size": 0}, {"no_such": 1}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            config.replace(**bad)
        with pytest.raises(ValidationError, match=next(iter(bad))):
            config.model_copy(update=bad)  # validated too, unlike pydantic's


def test_active_config_is_the_frozen_object():
    config = cr.CompilationConfig(backend="eager")
    with cr.set_compilation_config(config):
        with pytest.raises(AttributeError, match="replace"):
            cr.get_compilation_config().backend = "inductor"
    assert config.backend == "eager"
