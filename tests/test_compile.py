"""engine.compile: the compiled layer template computes the same step as the eager one."""

from conftest import make_model_dir
from reference import Megatrain, random_batches, rel


def test_compiled_layers_match_eager(tmp_path):
    make_model_dir(tmp_path, "qwen3", seed=41)
    eager, compiled = Megatrain(tmp_path), Megatrain(tmp_path, compile_layers=True)
    for step in range(2):
        batches = random_batches(2, 2, 97, [9, 9], seed=300 + step)
        loss_e, grads_e = eager.step(batches)
        loss_c, grads_c = compiled.step(batches)
        assert abs(loss_c - loss_e) <= 1e-6 * loss_e
        for name in grads_e:
            assert rel(grads_c[name], grads_e[name]) <= 1e-5, name
