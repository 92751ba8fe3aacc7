"""The Tc model's tree members on the CPU: tensor evaluation equal to scikit-learn's and LightGBM's predictions,
the exact float32 thresholds, the blend's weights and mixture, and a trained blend surviving save and load."""

import numpy as np
import pytest
import torch

from flashmoe_science.science.supercon_data import load_supercon
from flashmoe_science.science.supercon_model import composition_features
from flashmoe_science.science.supercon_train import TrainConfig, load_model, predict, save_model, train
from flashmoe_science.science.supercon_trees import TreeEnsemble, _round_down_float32, blend_weights

from test_supercon import TINY, TINY_OPTIONS, small_csv, supercon  # noqa: F401 (the fixture)

sklearn_ensemble = pytest.importorskip("sklearn.ensemble")
lightgbm = pytest.importorskip("lightgbm")


def _data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Float32 features with ties and repeated values (a discrete column, exact zeros), a nonlinear target."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 9)).astype(np.float32)
    x[:, 3] = rng.integers(0, 3, rows)
    x[rng.random((rows, 9)) < 0.3] = 0
    y = 3 * x[:, 0] + np.sin(4 * x[:, 1]) + 2 * (x[:, 3] == 1) + 0.1 * rng.normal(size=rows)
    return x, y


@pytest.mark.parametrize("rows", [1, 2, 37])
def test_forest_as_tensors_matches_scikit_learn(rows):
    x, y = _data(301, 0)
    forest = sklearn_ensemble.ExtraTreesRegressor(n_estimators=7, max_features=1 / 3, random_state=0).fit(x, y)
    trees = TreeEnsemble.from_sklearn(forest)
    test, _ = _data(rows, 1)
    mean, spread = trees.predict(torch.from_numpy(test))
    per_tree = np.stack([tree.predict(test) for tree in forest.estimators_], axis=1)
    torch.testing.assert_close(mean.double(), torch.from_numpy(forest.predict(test)), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(spread.double(), torch.from_numpy(per_tree.std(1, ddof=1)), rtol=1e-5, atol=1e-5)
    # the training rows sit on the thresholds' sides exactly: a full-depth forest returns their targets
    torch.testing.assert_close(trees.predict(torch.from_numpy(x))[0].double(), torch.from_numpy(forest.predict(x)),
                               rtol=1e-6, atol=1e-5)


def test_boosting_as_tensors_matches_lightgbm():
    x, y = _data(400, 2)
    model = lightgbm.LGBMRegressor(n_estimators=40, num_leaves=15, learning_rate=0.1, verbose=-1).fit(x, y)
    trees = TreeEnsemble.from_lightgbm(model.booster_)
    test = np.concatenate([_data(50, 3)[0], x[:50]])
    mean, spread = trees.predict(torch.from_numpy(test))
    torch.testing.assert_close(mean.double(), torch.from_numpy(model.predict(test)), rtol=1e-5, atol=1e-4)
    assert bool((spread == 0).all())
    empty = trees.predict(torch.zeros(0, x.shape[1]))[0]
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="x must be"):
        trees(torch.zeros(x.shape[1]))


def test_float32_thresholds_split_like_float64():
    rng = np.random.default_rng(4)
    x = rng.normal(size=20000).astype(np.float32)
    thresholds = np.concatenate([x[:5000].astype(np.float64) + rng.uniform(-1e-7, 1e-7, 5000),
                                 (x[5000:10000].astype(np.float64) + np.nextafter(x[5000:10000], np.inf)) / 2,
                                 x[10000:].astype(np.float64)])
    rounded = _round_down_float32(thresholds)
    assert rounded.dtype == np.float32 and bool((rounded.astype(np.float64) <= thresholds).all())
    for shift in (0, 1, 7):  # each x against other rows' thresholds too
        other = np.roll(x, shift)[:thresholds.size]
        np.testing.assert_array_equal(other <= rounded, other.astype(np.float64) <= thresholds)


def test_blend_weights_are_convex_and_least_squares():
    generator = torch.Generator().manual_seed(5)
    a, b, c = torch.randn(3, 200, generator=generator, dtype=torch.float64)
    weights = blend_weights(torch.stack([a, b, c]), 0.3 * a + 0.7 * b)
    torch.testing.assert_close(weights, torch.tensor([0.3, 0.7, 0.0], dtype=torch.float64), atol=1e-5, rtol=0)
    weights = blend_weights(torch.stack([a, -a]), a)  # the best convex point is a vertex
    torch.testing.assert_close(weights, torch.tensor([1.0, 0.0], dtype=torch.float64), atol=1e-6, rtol=0)
    # an unconstrained optimum outside the simplex: the weights stay non-negative and sum to one
    weights = blend_weights(torch.stack([a, b]), 2 * a - b)
    assert bool((weights >= 0).all()) and float(weights.sum()) == pytest.approx(1.0)


@pytest.mark.slow
def test_trained_blend_predicts_the_mixture_and_survives_save_and_load(small_csv, tmp_path):
    data, _ = load_supercon(small_csv)
    config = TrainConfig(epochs=1, batch_size=64, model=TINY, implementation="plain", forest_trees=5)
    model, metrics = train(data, config, torch.device("cpu"), progress=False)
    assert set(metrics["members"]) == {"transformer", "extra_trees", "lightgbm"}
    weights = torch.tensor([metrics["members"][name]["weight"] for name in ("transformer", "extra_trees",
                                                                              "lightgbm")])
    assert bool((weights >= 0).all()) and float(weights.sum()) == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(model.blend, weights.float())

    index = torch.arange(0, len(data), 7)
    batch = data.batch(index).padded()
    model.eval()
    mean, std = model.predict_samples(batch, 0)
    x = composition_features(data.elements, data.fractions, data.offsets)[index].double()
    means = [model.head(batch.pooled(model)).double()]
    spreads = [torch.zeros_like(means[0])]
    forest = model.members["extra_trees"].forward(x.float()).double()
    means += [forest.mean(1), model.members["lightgbm"].forward(x.float()).double().sum(1)]
    spreads += [forest.std(1), torch.zeros_like(means[0])]
    expected = sum(w * m for w, m in zip(weights.double(), means))
    variance = sum(w * (s ** 2 + (m - expected) ** 2) for w, s, m in zip(weights.double(), spreads, means))
    torch.testing.assert_close(mean.double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(std.double(), variance.sqrt(), rtol=1e-4, atol=1e-4)

    save_model(model, tmp_path / "model.pt")
    loaded = load_model(tmp_path / "model.pt")
    assert list(loaded.members) == ["extra_trees", "lightgbm"] and loaded.members["lightgbm"].reduction == "sum"
    assert loaded.members["extra_trees"].active == model.members["extra_trees"].active
    before = predict(model, data, index, "plain", torch.device("cpu"))[0]
    torch.testing.assert_close(predict(loaded, data, index, "plain", torch.device("cpu"))[0], before)


def test_transformer_alone_when_no_members(small_csv, tmp_path):
    args = ["train", "--data", str(small_csv), "--no-progress", "--epochs", "1", "--splits", "random", *TINY_OPTIONS]
    assert supercon(*args, "--members", "none", "--out", str(tmp_path / "alone")) == 0
    metrics = (tmp_path / "alone" / "random" / "metrics.json").read_text()
    assert '"members": {}' in metrics
    model = load_model(tmp_path / "alone" / "random" / "model.pt")
    assert len(model.members) == 0 and model.blend.tolist() == [1.0]
    with pytest.raises(SystemExit):  # argparse: one line naming the option
        supercon(*args, "--members", "extra_trees,forest", "--out", str(tmp_path / "bad"))
    data, _ = load_supercon(small_csv)
    with pytest.raises(ValueError, match="members"):
        train(data, TrainConfig(epochs=1, model=TINY, members=("forest",)), torch.device("cpu"), progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tree_walk_on_cuda_matches_cpu():
    x, y = _data(2000, 6)
    forest = TreeEnsemble.from_sklearn(sklearn_ensemble.ExtraTreesRegressor(n_estimators=20, random_state=0).fit(x, y))
    boosted = TreeEnsemble.from_lightgbm(lightgbm.LGBMRegressor(n_estimators=60, verbose=-1).fit(x, y).booster_)
    test = torch.from_numpy(_data(70000, 7)[0])
    for trees in (forest, boosted):
        on_cpu = trees.predict(test)
        on_gpu = [t.cpu() for t in trees.to("cuda").predict(test.cuda())]
        torch.testing.assert_close(on_gpu[0], on_cpu[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(on_gpu[1], on_cpu[1], rtol=1e-4, atol=1e-4)
