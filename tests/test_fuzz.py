"""Short fuzz trials (CI): configuration documents and saved indexes of random shapes and
values. A config is a CacheConfig or one ConfigError; an index whose metadata fields hold
random values (checksums made valid) opens into a working cache holding exactly its blocks,
never an exception. Longer runs: ``-m slow`` (more examples)."""

from __future__ import annotations

import json
import os

from helpers import assert_bytes, put_random
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache import ConfigError, TierCache
from tiercache.config import config_from_dict

EXAMPLES = int(os.environ.get("TIERCACHE_FUZZ_EXAMPLES", "60"))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.binary(max_size=8).map(lambda b: b.hex()))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)
SECTIONS = {"tiers": ["device_slots", "host_slots", "file_slots", "host_huge_pages"],
            "file": ["root", "fsync", "io_mode", "io_threads", "io_engine", "direct_io", "sharing", "min_age_s",
                     "tmp_max_age_s", "capacity_bytes", "open_files", "index_checkpoint_s"],
            "transfer": ["copy_kernel_sms", "bulk_sms"], "metrics": ["enabled", "registry"]}


@st.composite
def documents(draw):
    doc = {}
    for section, keys in SECTIONS.items():
        if draw(st.booleans()):
            doc[section] = {k: draw(values) for k in draw(st.lists(st.sampled_from(keys), max_size=4, unique=True))}
    if draw(st.booleans()):
        doc[draw(st.text(max_size=6))] = draw(values)  # an unknown section
    doc["pools"] = draw(st.one_of(values, st.just({"kv": {"block_shape": [64], "dtype": "uint8"}})))
    return doc


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(documents())
def test_a_config_document_is_a_config_or_one_config_error(doc):
    try:
        config_from_dict(doc)
    except ConfigError:
        pass


META_FIELDS = ["count", "arena", "clock", "body_xxh3", "dir_times", "positions", "root", "pools", "written"]


@settings(max_examples=max(10, EXAMPLES // 3), deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(META_FIELDS), value=values, data=st.data())
def test_an_index_with_random_metadata_opens_into_a_working_cache(make_config, rng, tmp_path_factory, field, value,
                                                                  data):
    from test_index_crafted import _parts, _write

    cfg = make_config(host_slots=8, file_slots=32, root=tmp_path_factory.mktemp("fuzz") / "root")
    with TierCache(cfg) as c:
        exp = put_random(c, list(range(10, 22)), rng, tier="file")
    meta, body = _parts(cfg.root)
    meta[field] = value
    if field == "body_xxh3":
        _write(cfg.root, None, body, meta_raw=json.dumps(meta).encode())  # the body's checksum as given
    else:
        _write(cfg.root, meta, body)
    with TierCache(cfg) as c:
        assert c.wait_reconciled(30)
        assert sorted(c.keys("file")) == sorted(exp)
        assert_bytes(c, exp)
        put_random(c, list(range(100, 130)), rng, tier="file")  # evictions work: not wedged
