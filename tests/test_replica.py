"""`model.gpus_per_replica`: which replica a process belongs to, which GPUs it holds and whether it writes; the
plan split over replicas and a resume with other replica layouts; the process model; the errors; the token budget
of a replica. Expected values are worked out by hand from the layouts (8 GPUs per node, 1 or 2 nodes)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, demo_overrides

from dflash_prep.plan.planner import PlannedBatch, split_across_ranks
from dflash_prep.recipe.schema import RecipeError, load_recipe
from dflash_prep.target.budget import auto_token_budget, resolve_token_budget
from dflash_prep.target.layers import num_decoder_layers, resolve_layer_ids
from dflash_prep.target.model import load_config, model_fingerprint
from dflash_prep.target.replica import (
    LAYER_SPLIT,
    SINGLE_GPU,
    TENSOR_PARALLEL,
    check_tensor_parallel_replicas,
    choose_parallelism,
    load_arguments,
    replica_layout,
)

CONFIGS = REPO / "bench" / "configs"


def layouts(num_nodes: int, gpus_per_node: int, n: int, parallelism: str):
    """Every process of a launch (accelerate numbers processes node by node), as replica_layout sees it."""
    per_node = gpus_per_node if parallelism in (TENSOR_PARALLEL, SINGLE_GPU) else gpus_per_node // n
    world = num_nodes * per_node
    return [replica_layout(node * per_node + local, world, local, per_node, gpus_per_node, n, parallelism)
            for node in range(num_nodes) for local in range(per_node)]


def facts(layout):
    return (layout.replica_index, layout.num_replicas, layout.rank_in_replica, layout.gpu_ids, layout.is_writer)


def test_one_gpu_per_replica_is_one_process_per_rank():
    assert [facts(x) for x in layouts(1, 4, 1, SINGLE_GPU)] == [
        (0, 4, 0, (0,), True), (1, 4, 0, (1,), True), (2, 4, 0, (2,), True), (3, 4, 0, (3,), True)]
    cpu = replica_layout(1, 2, 1, 2, 0, 1, SINGLE_GPU)  # the CPU tests' two processes
    assert facts(cpu) == (1, 2, 0, (), True)


def test_tensor_parallel_8_gpus_as_2_replicas_of_4():
    got = [facts(x) for x in layouts(1, 8, 4, TENSOR_PARALLEL)]
    first, second = (0, 1, 2, 3), (4, 5, 6, 7)
    assert got == [(0, 2, 0, first, True), (0, 2, 1, first, False), (0, 2, 2, first, False), (0, 2, 3, first, False),
                   (1, 2, 0, second, True), (1, 2, 1, second, False), (1, 2, 2, second, False),
                   (1, 2, 3, second, False)]


def test_tensor_parallel_1_replica_of_8_and_2_nodes():
    assert {facts(x)[:2] for x in layouts(1, 8, 8, TENSOR_PARALLEL)} == {(0, 1)}
    two_nodes = layouts(2, 8, 4, TENSOR_PARALLEL)  # 16 processes, 4 replicas; process 13 = node 1, local 5
    assert facts(two_nodes[13]) == (3, 4, 1, (4, 5, 6, 7), False)
    assert facts(two_nodes[8]) == (2, 4, 0, (0, 1, 2, 3), True)
    assert sum(x.is_writer for x in two_nodes) == 4


def test_layer_split_one_process_per_replica():
    assert [facts(x) for x in layouts(1, 8, 4, LAYER_SPLIT)] == [(0, 2, 0, (0, 1, 2, 3), True),
                                                                 (1, 2, 0, (4, 5, 6, 7), True)]
    two_nodes = layouts(2, 8, 2, LAYER_SPLIT)  # 4 processes per node, 8 replicas
    assert facts(two_nodes[5]) == (5, 8, 0, (2, 3), True)


@pytest.mark.parametrize("num_nodes,gpus,n,parallelism",
                         [(1, 8, 2, TENSOR_PARALLEL), (2, 8, 8, TENSOR_PARALLEL), (2, 4, 4, LAYER_SPLIT),
                          (1, 6, 3, LAYER_SPLIT), (3, 2, 2, TENSOR_PARALLEL)])
def test_every_replica_has_one_writer_and_its_own_gpus_of_one_node(num_nodes, gpus, n, parallelism):
    procs = layouts(num_nodes, gpus, n, parallelism)
    num_replicas = num_nodes * gpus // n
    assert {x.num_replicas for x in procs} == {num_replicas}
    by_replica: dict = {}
    for i, x in enumerate(procs):
        node = i // (len(procs) // num_nodes)
        by_replica.setdefault(x.replica_index, []).append((node, x))
    assert sorted(by_replica) == list(range(num_replicas))
    for members in by_replica.values():
        assert sum(x.is_writer for _, x in members) == 1
        assert len({node for node, _ in members}) == 1  # a replica never crosses nodes
        assert len({x.gpu_ids for _, x in members}) == 1 and len(members[0][1].gpu_ids) == n
    for node in range(num_nodes):  # the replicas of a node hold disjoint GPUs, all of them
        held = [g for members in by_replica.values() if members[0][0] == node for g in members[0][1].gpu_ids]
        assert sorted(held) == list(range(gpus))


@pytest.mark.parametrize("args,words", [
    ((0, 8, 0, 8, 8, 16, TENSOR_PARALLEL), "this node has 8 GPU(s); a replica is GPUs of one node"),
    ((0, 1, 0, 1, 0, 2, LAYER_SPLIT), "this node has 0 GPU(s)"),
    ((0, 8, 0, 8, 8, 3, TENSOR_PARALLEL), "does not divide this node's 8 GPUs"),
    ((0, 2, 0, 2, 8, 4, TENSOR_PARALLEL), "launch with --num_processes 8 per node"),
    ((0, 8, 0, 8, 8, 4, LAYER_SPLIT), "launch with --num_processes 2 per node"),
])
def test_layouts_that_do_not_divide_are_errors_naming_the_key(args, words):
    with pytest.raises(RecipeError) as e:
        replica_layout(*args)
    assert str(e.value).startswith(f"recipe key `model.gpus_per_replica` = {args[5]}:") and words in str(e.value)


def test_tensor_parallel_where_transformers_has_a_plan_else_a_layer_split():
    from transformers import GPT2Config

    llama = load_config(load_recipe(None, [f"model.config={CONFIGS / 'llama3.3-70b.json'}"]).model)
    qwen35 = load_config(load_recipe(None).model)  # the demo's Qwen3.5 hybrid (a composite config)
    assert choose_parallelism(llama, 1) == SINGLE_GPU
    assert choose_parallelism(llama, 1, LAYER_SPLIT) == SINGLE_GPU
    assert choose_parallelism(llama, 4) == TENSOR_PARALLEL  # random weights too (materialized per shard)
    assert choose_parallelism(qwen35, 2) == TENSOR_PARALLEL
    assert choose_parallelism(llama, 4, LAYER_SPLIT) == LAYER_SPLIT  # asked for
    assert choose_parallelism(llama, 4, one_process_per_replica=True) == LAYER_SPLIT  # launched GPUs / N processes
    assert choose_parallelism(llama, 4, TENSOR_PARALLEL, one_process_per_replica=True) == TENSOR_PARALLEL
    assert choose_parallelism(GPT2Config(), 2) == LAYER_SPLIT  # no tp plan for GPT-2
    with pytest.raises(RecipeError, match=r"`model.replica_parallelism` = 'tensor_parallel': transformers has no "
                                          r"tensor-parallel plan for GPT2Config"):
        choose_parallelism(GPT2Config(), 2, TENSOR_PARALLEL)
    with pytest.raises(RecipeError, match=r"`model.replica_parallelism` = 'pipeline': expected one of"):
        load_recipe(None, ["model.replica_parallelism=pipeline"])


def test_load_arguments_per_process_model():
    one_replica = layouts(1, 2, 2, TENSOR_PARALLEL)[1]
    tp = load_arguments(one_replica)["distributed_config"]
    assert (tp.tp_size, tp.tp_plan) == (2, "auto")
    check_tensor_parallel_replicas(one_replica)  # one replica: fine
    with pytest.raises(RecipeError, match=r"`model.gpus_per_replica` = 4: tensor parallelism runs one replica per "
                                          r"run, this launch makes 2; use gpus_per_replica = the run's 8 GPUs"):
        check_tensor_parallel_replicas(layouts(1, 8, 4, TENSOR_PARALLEL)[5])
    split = layouts(1, 8, 4, LAYER_SPLIT)[1]
    assert load_arguments(split, 10**11) == {"device_map": "auto",
                                             "max_memory": {4: 10**11, 5: 10**11, 6: 10**11, 7: 10**11}}


def _plan(num_batches: int) -> list[PlannedBatch]:
    return [PlannedBatch(batch_id=i, sample_indices=(i,), padded_length=64 * (1 + i % 5), num_real_tokens=50)
            for i in range(num_batches)]


def _run(plan, committed: set, procs, fraction: float) -> set:
    """One run of a layout: every process takes its replica's share of the uncommitted batches; the processes of
    a replica agree on it; the writer commits the first `fraction` of it (then the run is killed)."""
    todo = [p for p in plan if p.batch_id not in committed]
    shares = {}
    for x in procs:
        mine = [p.batch_id for p in split_across_ranks(todo, x.num_replicas)[x.replica_index]]
        assert shares.setdefault(x.replica_index, mine) == mine  # every process of a replica runs the same batches
    done = set()
    for x in procs:
        if x.is_writer:
            mine = shares[x.replica_index]
            done |= set(mine[:int(len(mine) * fraction)])
    assert not done & committed
    return done


def test_a_resume_may_change_the_gpus_per_replica_and_the_number_of_replicas():
    """8 GPUs as 8 x 1, killed; 2 x 4 (tensor parallel), killed; 1 x 8; 2 nodes x 8 GPUs as 8 x 2 (layer split),
    killed; 4 x 2 finishes. Every batch of the plan is committed exactly once."""
    plan = _plan(101)
    committed: set = set()
    for procs, fraction in [(layouts(1, 8, 1, SINGLE_GPU), 0.3), (layouts(1, 8, 4, TENSOR_PARALLEL), 0.5),
                            (layouts(1, 8, 8, TENSOR_PARALLEL), 0.25), (layouts(2, 8, 2, LAYER_SPLIT), 0.5),
                            (layouts(1, 8, 2, TENSOR_PARALLEL), 1.0)]:
        done = _run(plan, committed, procs, fraction)
        assert done  # every run made progress
        committed |= done
    assert committed == set(range(101))


def test_auto_budget_counts_the_replicas_memory():
    # Llama-3.3-70B shape, bf16, EAGLE-3 3 layers + final = 4 captured: per padded token
    # 2 x (12 x 8192 + 4 x 28672) + 2 x 4 x 8192 = 491,520 bytes.
    # 141 GB of weights on a 143 GB GPU: 1 GPU -> 0.4 x 2e9 / 491,520 = 1,627 -> the floor 8,192;
    # 2 GPUs: 0.4 x (143e9 - 70.5e9) / 491,520 = 59,001 -> 32,768; 4 GPUs: 0.4 x 107.75e9 / 491,520 = 87,687 -> 65,536.
    assert auto_token_budget(143 * 10**9, 141 * 10**9, 491_520)[0] == 8192
    two, how = auto_token_budget(143 * 10**9, 141 * 10**9, 491_520, 2)
    assert two == 32768 and "/ 2 GPUs of the replica" in how and "= 59,001" in how
    assert auto_token_budget(143 * 10**9, 141 * 10**9, 491_520, 4)[0] == 65536
    # The same through the recipe: the 70B-shape config's weights counted on the meta device (~141 GB in bf16).
    recipe = load_recipe(None, [f"model.config={CONFIGS / 'llama3.3-70b.json'}", "model.dtype=bfloat16",
                                "layers.preset=eagle3", "layers.capture_final=before_norm",
                                "batching.max_tokens_per_batch=auto", "model.gpus_per_replica=2"])
    config = load_config(recipe.model)
    n = num_decoder_layers(config)
    ids = resolve_layer_ids(recipe.layers, n)
    resolved, how = resolve_token_budget(recipe, config, ids, n, 143 * 10**9)
    assert resolved.batching.max_tokens_per_batch == 32768 and "/ 2 GPUs of the replica" in how
    import dataclasses
    alone = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, gpus_per_replica=1))
    assert resolve_token_budget(alone, config, ids, n, 143 * 10**9)[0].batching.max_tokens_per_batch == 8192


def test_the_key_is_checked_and_is_not_part_of_the_jobs_identity():
    with pytest.raises(RecipeError, match=r"`model.gpus_per_replica` = 0: expected a whole number of GPUs"):
        load_recipe(None, ["model.gpus_per_replica=0"])
    with pytest.raises(RecipeError, match=r"`model.gpus_per_replica` = 1.5: expected an integer"):
        load_recipe(None, ["model.gpus_per_replica=1.5"])
    one, four = load_recipe(None), load_recipe(None, ["model.gpus_per_replica=4"])
    assert one.fingerprint() == four.fingerprint()
    assert four.fingerprint() == load_recipe(None, ["model.gpus_per_replica=4",
                                                    "model.replica_parallelism=layer_split"]).fingerprint()
    pretrained = [load_recipe(None, ["model.config=null", f"model.name_or_path={REPO}", f"model.gpus_per_replica={n}"])
                  for n in (1, 4)]
    config = load_config(one.model)
    assert model_fingerprint(pretrained[0].model, config) == model_fingerprint(pretrained[1].model, config)
    # random weights of a replica of several GPUs are drawn per module: another model than one GPU's
    assert model_fingerprint(one.model, config) != model_fingerprint(four.model, config)


@pytest.mark.slow
def test_an_extraction_asking_for_more_gpus_than_the_node_has_stops_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "extract.py", *[a for o in demo_overrides(tmp_path / "out")
                                                           for a in ("--set", o)], "--set", "model.gpus_per_replica=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert errors == ["error: recipe key `model.gpus_per_replica` = 2: this node has 0 GPU(s); a replica is GPUs of "
                      "one node (set it to 1 without GPUs)"]
    assert not (tmp_path / "out" / "plan.json").exists()  # stopped before the plan, the data, the weights
