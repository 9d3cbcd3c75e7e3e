"""Rolling-cache settings (swift_liger/cache/settings.py): the one check of window / sinks / mode / cuda_graph, which
loads without torch, and the LigerConfig / flag spellings (fusions/rolling_cache.py) built on it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swift_liger.cache.settings import (MODEL_WINDOW, ROLLING_CACHE_KEYS, ROLLING_CACHE_MODES, RollingCacheRefused,
                                        check_settings)


def test_settings_load_without_torch():
    """The fusion spec, LigerConfig and the flags import the settings without torch or transformers."""
    root = Path(__file__).resolve().parents[2]
    code = ("import swift_liger.cache.settings, sys; assert 'torch' not in sys.modules; "
            "assert 'transformers' not in sys.modules; import swift_liger.cache; "
            "assert 'torch' not in sys.modules, 'swift_liger.cache imported torch'; "
            "print(swift_liger.cache.settings.__file__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve() == root / "swift_liger" / "cache" / "settings.py"


def test_check_settings_completes_and_refuses():
    assert check_settings(64) == {"window": 64, "sinks": 4, "mode": "absolute", "cuda_graph": False}
    assert check_settings(64, 0, "streaming", True) == {"window": 64, "sinks": 0, "mode": "streaming",
                                                        "cuda_graph": True}
    assert check_settings(" Model ") == {"window": MODEL_WINDOW, "sinks": 0, "mode": "absolute", "cuda_graph": False}
    assert check_settings("model", 0) == check_settings("model")
    assert check_settings(" Exact ", cuda_graph=True) == {"window": "exact", "sinks": 0, "mode": "absolute",
                                                          "cuda_graph": True}
    for args, message in [
            ((0,), "RollingKVCache: window must be an int >= 1, got 0"),
            ((True,), "RollingKVCache: window must be an int >= 1, got True"),
            ((4, -1), "RollingKVCache: sinks must be an int >= 0, got -1"),
            ((4, 4), "RollingKVCache: sinks must be < window, got sinks=4, window=4"),
            ((4, 1, "relative"), "RollingKVCache: mode must be one of absolute, streaming, got 'relative'"),
            ((4, 1, "absolute", 1), "RollingKVCache: cuda_graph must be true or false, got 1"),
            (("auto",), "RollingKVCache: window must be an int >= 1, 'model' (the model's own sliding window) or "
                        "'exact' (a ring per generate call of prompt + new tokens), got 'auto'"),
            (("exact", 4), "RollingKVCache: window 'exact' holds every token of the call (nothing is evicted), so it "
                           "has no sinks; got sinks=4 (leave sinks out or give 0)"),
            (("exact", 0, "streaming"), "RollingKVCache: window 'exact' needs mode 'absolute' (true RoPE positions), "
                                        "got 'streaming'")]:
        with pytest.raises(ValueError) as info:
            check_settings(*args)
        assert str(info.value) == message
    with pytest.raises(ValueError, match="^LigerConfig.rolling_cache: window 'model' needs mode 'absolute'"):
        check_settings("model", mode="streaming", where="LigerConfig.rolling_cache")
    assert ROLLING_CACHE_MODES == ("absolute", "streaming")
    assert ROLLING_CACHE_KEYS == ("window", "sinks", "mode", "cuda_graph")
    assert issubclass(RollingCacheRefused, ValueError)


def test_flag_and_config_spelling():
    from swift_liger.config import LigerConfig
    from swift_liger.fusions.rolling_cache import normalize, parse_flag
    assert parse_flag("model") == {"window": "model"}
    assert parse_flag(" Model ") == {"window": "model"}
    assert parse_flag('{"window": "model"}') == {"window": "model"}
    assert parse_flag("64,4") == {"window": 64, "sinks": 4}
    assert parse_flag("64, 4, Graph") == {"window": 64, "sinks": 4, "cuda_graph": True}
    with pytest.raises(ValueError, match='optionally ",graph"'):
        parse_flag("64,4,fast")
    assert normalize({"window": "MODEL"}) == {"window": "model"}
    assert LigerConfig(rolling_cache={"window": "model"}).rolling_cache == {"window": "model"}
    with pytest.raises(ValueError, match='liger_rolling_cache must be "window,sinks" \\(two integers, optionally '
                                         '",graph"\\), "model"'):
        parse_flag("auto")
    with pytest.raises(ValueError, match="LigerConfig.rolling_cache: window 'model' keeps the model's own sliding "
                                         "window exactly, without sinks"):
        LigerConfig(rolling_cache={"window": "model", "sinks": 2})
    with pytest.raises(ValueError, match="LigerConfig.rolling_cache: window must be an int >= 1, 'model'"):
        LigerConfig(rolling_cache={"window": "global"})
    assert parse_flag("exact") == {"window": "exact", "sinks": 0, "cuda_graph": False}
    assert parse_flag(" Exact,Graph ") == {"window": "exact", "sinks": 0, "cuda_graph": True}
    assert normalize({"window": "EXACT", "cuda_graph": True}) == {"window": "exact", "cuda_graph": True}
