"""examples/generate.py: a recall model saved by entmax_fast.train's save_model, loaded back,
decoded query by query from a paged cache with ragged lengths; the example itself checks the
decoded logits against the model's full forward (it raises when they differ)."""
import torch

from entmax_fast.train import Config, load_model, recall_batch, save_model, train_one
from test_tools import load_script


def test_a_saved_model_loads_back_with_the_same_outputs(tmp_path):
    config = Config(steps=3, batch=8, eval_batch=16, long_pairs=0, attentions=("learned",))
    model = train_one(config, "learned", show_progress=False)["model"]
    save_model(str(tmp_path / "recall.pt"), model, config, "learned")
    loaded, loaded_config = load_model(str(tmp_path / "recall.pt"))
    assert loaded_config == config and not loaded.training
    keys, values, query_keys, _ = recall_batch(config, 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(keys, values, query_keys)[0], model.eval()(keys, values, query_keys)[0],
                                   atol=0, rtol=0)


def test_decoding_from_the_paged_cache_matches_the_full_forward(tmp_path):
    config = Config(steps=3, batch=8, eval_batch=16, long_pairs=0, attentions=("entmax15",))
    save_model(str(tmp_path / "recall.pt"), train_one(config, "entmax15", show_progress=False)["model"], config,
               "entmax15")
    example = load_script("examples/generate.py")
    result = example.main(["--checkpoint", str(tmp_path / "recall.pt"), "--sequences", "5", "--seed", "3"])
    assert len(result["pairs"]) == 5 and len(set(result["pairs"])) > 1  # ragged prompts
    assert result["cache_seqlens"] == [pairs + config.queries for pairs in result["pairs"]]
    assert result["max_logit_difference"] < 1e-4
    assert 0.0 <= result["decoded_accuracy"] <= 1.0 and 0.0 <= result["forward_accuracy"] <= 1.0


def test_the_example_trains_a_model_without_a_checkpoint():
    example = load_script("examples/generate.py")
    result = example.main(["--train-steps", "5", "--sequences", "2"])
    assert result["max_logit_difference"] < 1e-4
