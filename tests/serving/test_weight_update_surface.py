"""Issue 28, items 1-3: what `/update_weights_from_disk` may load, and the numbers a client may send.

- Paths and links under ``--weight-update-root``: every path is resolved (folders and files, through every link)
  before the root check, and every unloadable path gets one answer that says nothing about the file.
- Completeness: an update names every parameter of the served model; a sharded folder's index names shards that are
  all there (a missing one is named).
- Numbers: every integer field of every request is bounded (int64 at most) in the published schema and refused past
  it; temperatures below the greedy threshold decode greedily with finite log-probs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from relax.backends.inference.base import GREEDY_TEMPERATURE, SamplingParams
from relax.serving.protocol import INT64_MAX
from tests.support.http_servers import API_KEY, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate))  # no shrinking: each case is a real server call


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A folder outside the root: a complete copy of the model's weights and a secret file."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "secret.txt").write_text("top secret contents " * 40)
    return folder


@pytest.fixture(scope="module")
def served(tiny_workspace, tmp_path_factory, outside):
    root = tmp_path_factory.mktemp("root")
    server = Server(tiny_workspace / "model", weight_update_root=root)
    tensors = load_file(str(tiny_workspace / "model" / "model.safetensors"))
    save_file(tensors, str(outside / "model.safetensors"))
    try:
        yield server, root, tensors
    finally:
        server.stop()


def _update(server: Server, model_path: str, **extra) -> httpx.Response:
    return httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": model_path, **extra},
                      headers=AUTH, timeout=60)


def _not_loadable_message(response: httpx.Response, path: str) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"].replace(repr(path), "PATH")


_counter = iter(range(10**9))


def _folder(root: Path) -> Path:
    folder = root / f"f{next(_counter)}"
    folder.mkdir()
    return folder


# ---- item 1: links out of the root --------------------------------------------------------------------------------
def test_a_weight_file_linked_out_of_the_root_is_refused_like_a_missing_path(served, outside):
    server, root, _ = served
    version = server.engine.weight_version
    linked = _folder(root)
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")  # a complete model, outside the root
    secret = _folder(root)
    (secret / "model.safetensors").symlink_to("/etc/passwd")
    text = _folder(root)
    (text / "model.safetensors").symlink_to(outside / "secret.txt")
    reference = _not_loadable_message(_update(server, "no/such/folder"), "no/such/folder")
    for folder in (linked, secret, text):
        response = _update(server, folder.name)
        assert _not_loadable_message(response, folder.name) == reference
        body = response.text
        assert "root:x:0" not in body and "secret" not in body  # nothing of the file
        assert not any(str(n) in body for n in (os.path.getsize("/etc/passwd"),
                                                (outside / "secret.txt").stat().st_size))
    assert server.engine.weight_version == version


def test_links_inside_the_root_load(served):
    server, root, tensors = served
    real = _folder(root)
    save_file(tensors, str(real / "model.safetensors"))
    via_file = _folder(root)
    (via_file / "model.safetensors").symlink_to(real / "model.safetensors")
    assert _update(server, via_file.name).status_code == 200
    via_folder = root / f"link{next(_counter)}"
    via_folder.symlink_to(real)
    assert _update(server, via_folder.name).status_code == 200


@PROPERTY
@given(steps=st.lists(st.sampled_from(["in-file", "out-file", "out-folder", "in-folder", "dotdot", "missing"]),
                      min_size=1, max_size=3))
def test_an_update_loads_only_when_every_path_resolves_inside_the_root(served, outside, steps):
    """A folder whose model file is reached through a chain of links and ``..``: loaded exactly when the folder and
    the file it finally names both lie inside the root (and the file is a whole model)."""
    server, root, tensors = served
    case = _folder(root)
    target = case / "real.safetensors"
    save_file(tensors, str(target))
    inside = True
    current = target
    for index, step in enumerate(steps):
        link = case / f"hop{index}.safetensors"
        if step == "in-file":
            link.symlink_to(current)
        elif step == "out-file":
            link.symlink_to(outside / "model.safetensors")
            inside = False
        elif step == "out-folder":
            link.symlink_to(outside / ".." / outside.name / "model.safetensors")
            inside = False
        elif step == "in-folder":
            link.symlink_to(Path("..") / case.name / current.name)
        elif step == "dotdot":
            link.symlink_to(root / ".." / root.name / case.name / current.name)
        else:  # a dangling link
            link.symlink_to(case / "nowhere.safetensors")
            inside = False
        current = link
    model = _folder(root)
    (model / "model.safetensors").symlink_to(current)
    version = server.engine.weight_version
    response = _update(server, model.name)
    if inside:
        assert response.status_code == 200, response.text
    else:
        assert _not_loadable_message(response, model.name) == _not_loadable_message(_update(server, "nope"), "nope")
        assert server.engine.weight_version == version
    shutil.rmtree(case)
    shutil.rmtree(model)


def test_a_versioned_directory_whose_files_link_out_is_refused(served, outside, tmp_path):
    import asyncio

    from relax.distributed.weight_disk import DiskPublisher

    server, root, tensors = served
    sync = root / f"sync{next(_counter)}"
    asyncio.run(DiskPublisher(sync, fsync=False).publish([list(tensors.items())], version=7))
    bucket = sync / "v00000007" / "bucket_00000.safetensors"
    bucket.unlink()
    bucket.symlink_to(outside / "model.safetensors")
    version = server.engine.weight_version
    assert _not_loadable_message(_update(server, sync.name), sync.name) == \
        _not_loadable_message(_update(server, "nope"), "nope")
    assert server.engine.weight_version == version


# ---- item 2: incomplete weights ------------------------------------------------------------------------------------
def test_a_folder_holding_part_of_the_model_is_refused(served):
    server, root, tensors = served
    version = server.engine.weight_version
    for keep in (1, len(tensors) - 1):
        folder = _folder(root)
        save_file(dict(list(tensors.items())[:keep]), str(folder / "model.safetensors"))
        response = _update(server, folder.name)
        assert response.status_code == 400 and "every parameter" in response.text, response.text
        assert server.engine.weight_version == version


def test_tied_weights_count_once_under_either_name(served):
    server, root, tensors = served
    model = server.engine.model
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        pytest.skip("the tiny model does not tie its embeddings")
    folder = _folder(root)
    without_head = {name: t for name, t in tensors.items() if name != "lm_head.weight"}
    save_file(without_head, str(folder / "model.safetensors"))
    assert _update(server, folder.name).status_code == 200


def _sharded(root: Path, tensors: dict[str, torch.Tensor], shards: int = 3) -> tuple[Path, dict[str, str]]:
    folder = _folder(root)
    names = sorted(tensors)
    weight_map = {}
    for index in range(shards):
        shard = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[index::shards]}
        save_file(part, str(folder / shard))
        weight_map.update({name: shard for name in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder, weight_map


def test_a_sharded_checkpoint_loads_and_a_missing_shard_is_named(served):
    server, root, tensors = served
    folder, _ = _sharded(root, tensors)
    assert _update(server, folder.name).status_code == 200
    broken, _ = _sharded(root, tensors)
    (broken / "model-00002-of-00003.safetensors").unlink()
    version = server.engine.weight_version
    response = _update(server, broken.name)
    assert response.status_code == 400 and "model-00002-of-00003.safetensors" in response.text
    assert "missing" in response.text and server.engine.weight_version == version
    stray, weight_map = _sharded(root, tensors)
    weight_map[next(iter(weight_map))] = "../../outside.safetensors"
    (stray / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert _update(server, stray.name).status_code == 400


# ---- item 3: numbers without bounds --------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [2**63, 2**70, int("9" * 4000)])
def test_a_weight_version_past_int64_is_refused(served, version):
    server, root, tensors = served
    folder = _folder(root)
    save_file(tensors, str(folder / "model.safetensors"))
    served_version = server.engine.weight_version
    body = '{"model_path": "%s", "weight_version": %d}' % (folder.name, version)
    response = httpx.post(f"{server.url}/update_weights_from_disk", content=body, timeout=60,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert server.engine.weight_version == served_version
    assert _update(server, folder.name, weight_version=served_version + 1).status_code == 200  # later ones still pass


def _integer_fields(node, path=()):
    """(path, schema) of every integer in a JSON schema."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            yield path, node
        for key, child in node.items():
            yield from _integer_fields(child, (*path, key))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield from _integer_fields(child, (*path, index))


def test_every_integer_of_every_request_is_bounded_within_int64(served):
    server, _, _ = served
    schema = httpx.get(f"{server.url}/openapi.json").json()
    found = list(_integer_fields(schema["components"]["schemas"]))
    assert len(found) > 10
    for path, field in found:
        if "ErrorDetail" in path:  # a response, not a request
            continue
        # seeds take torch's full uint64 range (the schema writes 2**64 - 1 as a float: 2**64 after rounding)
        assert "maximum" in field and field["maximum"] <= 2**64, path
        assert "minimum" in field and field["minimum"] >= -(2**63), path
        if "seed" not in path:
            assert float(field["maximum"]) <= float(INT64_MAX), path  # floats past 2**53 in the schema


@PROPERTY
@given(field=st.sampled_from(["max_new_tokens", "top_k", "seed"]),
       excess=st.one_of(st.integers(1, 10), st.just(2**70), st.just(int("9" * 4000))))
def test_integers_past_their_bound_are_400_naming_the_field(served, field, excess):
    server, _, _ = served
    bound = {"max_new_tokens": 2**31 - 1, "top_k": 2**31 - 1, "seed": 2**64 - 1}[field]
    value = excess if excess > bound else bound + excess
    body = '{"input_ids": [5], "sampling_params": {"%s": %d}}' % (field, value)
    response = httpx.post(f"{server.url}/generate", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"] or response.json()["error"]["param"] == "body"


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 5e-324, GREEDY_TEMPERATURE / 2])
def test_tiny_temperatures_decode_greedily_with_finite_log_probs(served, temperature):
    server, _, _ = served

    def generate(params: dict) -> dict:
        response = httpx.post(f"{server.url}/generate", timeout=60, json={
            "input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, **params}})
        assert response.status_code == 200, response.text
        return response.json()

    greedy, tiny = generate({"temperature": 0}), generate({"temperature": temperature, "seed": 3})
    assert tiny["output_ids"] == greedy["output_ids"] and len(tiny["output_ids"]) == 6
    assert all(entry[0] is not None for entry in tiny["meta_info"]["output_token_logprobs"])
    top_p = generate({"temperature": 1.0, "top_p": 1e-38, "seed": 3})  # keeps the most likely token only
    assert top_p["output_ids"] == greedy["output_ids"]


def test_sampling_params_below_the_threshold_are_greedy():
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 10).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_TEMPERATURE).temperature == GREEDY_TEMPERATURE
    assert SamplingParams(temperature=0.7).temperature == 0.7
