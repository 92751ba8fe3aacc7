"""Tree-ensemble members of the Tc model: extra trees (scikit-learn) and gradient-boosted trees (LightGBM) on the
classic composition features, trained beside the transformer and blended with it, evaluated as tensors.

A fitted ensemble becomes flat node arrays (every tree's nodes end to end): the split feature, the threshold, the
two children and the leaf value of each node, a leaf pointing at itself. Evaluation walks all trees of all rows at
once, one level per step (``x[feature[node]] <= threshold[node]`` picks the child): a few gathers per level on
whatever device holds the model, so screening scores the trees on the GPU beside the transformer, and a saved
model is tensors only (``torch.load(..., weights_only=True)`` reads it).

The features are float32 (as the libraries see them), and each threshold is stored as the largest float32 not above
the library's float64 threshold: for a float32 ``x``, ``x <= t64`` holds exactly when ``x <= floor32(t64)``, so the
tensor walk takes the same path as scikit-learn and LightGBM.

The blend: the transformer's and the members' predictions weighted by convex weights (non-negative, summing to
one) that minimise the squared error on the validation rows. Its uncertainty is the standard deviation of the
weighted mixture: ``sum_i w_i (s_i^2 + (m_i - m)^2)``, each member's own spread (the transformer's MC-dropout
samples, the extra trees' spread over trees; 0 for boosting, a sum of trees) plus the members' disagreement.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flashmoe_science.errors import CommandError

MEMBERS = ("extra_trees", "lightgbm")
LIGHTGBM_MAX_TREES = 5000
LIGHTGBM_PATIENCE = 100  # rounds without a better validation loss before LightGBM stops


def science_modules():
    """scikit-learn and LightGBM (the ``[science]`` extra), or a CommandError saying how to install them."""
    try:
        import lightgbm
        import sklearn.ensemble
        import sklearn.neighbors
    except ImportError as error:
        raise CommandError(f"the tree models need scikit-learn and LightGBM ({error}): "
                           "pip install -e \".[science]\"") from None
    return sklearn, lightgbm


def fit_member(name: str, x: dict[str, np.ndarray], y: dict[str, np.ndarray], seed: int, trees: int,
               threads: int, min_samples_leaf: int = 1):
    """Fits tree model ``name`` on ``x["train"]``: extra trees of ``trees`` trees, or LightGBM with early stopping
    on ``x["val"]``. Returns the fitted scikit-learn / LightGBM estimator."""
    if name not in MEMBERS:
        raise ValueError(f"name must be one of {MEMBERS}, got {name!r}")
    sklearn, lightgbm = science_modules()
    if name == "extra_trees":
        model = sklearn.ensemble.ExtraTreesRegressor(n_estimators=trees, max_features=1 / 3,
                                                     min_samples_leaf=min_samples_leaf, random_state=seed,
                                                     n_jobs=threads)
        return model.fit(x["train"], y["train"])
    model = lightgbm.LGBMRegressor(n_estimators=LIGHTGBM_MAX_TREES, learning_rate=0.03, num_leaves=63,
                                   subsample=0.8, subsample_freq=1, colsample_bytree=0.5, random_state=seed,
                                   n_jobs=threads, verbose=-1)
    return model.fit(x["train"], y["train"], eval_X=(x["val"],), eval_y=(y["val"],),
                     callbacks=[lightgbm.early_stopping(LIGHTGBM_PATIENCE, verbose=False)])


def _round_down_float32(threshold: np.ndarray) -> np.ndarray:
    """The largest float32 not above each float64 threshold."""
    rounded = threshold.astype(np.float32)
    above = rounded.astype(np.float64) > threshold
    rounded[above] = np.nextafter(rounded[above], np.float32(-np.inf))
    return rounded


class TreeEnsemble(nn.Module):
    """Trees as flat node arrays (buffers): ``forward(x (B, F) float32)`` -> each tree's leaf value ``(B, trees)``;
    :meth:`predict` reduces them as the ensemble does (``"mean"``: a forest, ``"sum"``: boosting).

    Node ``n`` splits on ``feature[n]`` at ``threshold[n]``; its children are ``child[2n]`` (``x <= threshold``)
    and ``child[2n + 1]``; a leaf has itself as both children and threshold +inf. The trees are stored deepest
    first, so the trees still walking at level ``s`` are a prefix (``active[s]`` of them): the walk costs the sum of
    the trees' depths, not the number of trees times the deepest (LightGBM's leaf-wise trees: about half)."""

    def __init__(self, feature, threshold, children, value, roots, active: list[int], reduction: str):
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.reduction, self.active = reduction, [int(count) for count in active]
        for name, tensor, dtype in (("feature", feature, torch.int32), ("threshold", threshold, torch.float32),
                                    ("child", children, torch.int32), ("value", value, torch.float32),
                                    ("roots", roots, torch.int32)):
            self.register_buffer(name, torch.as_tensor(np.asarray(tensor)).to(dtype))

    @classmethod
    def from_sklearn(cls, forest) -> "TreeEnsemble":
        """A fitted scikit-learn forest regressor (single output): mean of its trees."""
        trees = []
        for estimator in forest.estimators_:
            tree = estimator.tree_
            ids = np.arange(tree.node_count)
            leaf = tree.children_left < 0
            trees.append((np.where(leaf, 0, tree.feature), np.where(leaf, np.inf, tree.threshold),
                          np.where(leaf, ids, tree.children_left), np.where(leaf, ids, tree.children_right),
                          tree.value[:, 0, 0], tree.max_depth))
        return cls._concatenate(trees, "mean")

    @classmethod
    def from_lightgbm(cls, booster) -> "TreeEnsemble":
        """A fitted LightGBM regression booster (its ``dump_model()``; numerical ``<=`` splits): sum of its
        trees (the first holds the initial score)."""
        trees = []
        for info in booster.dump_model()["tree_info"]:
            nodes = []  # (feature, threshold, left, right, value), children as ids within the tree

            def visit(node: dict) -> int:
                index = len(nodes)
                nodes.append(None)
                if "leaf_value" in node:
                    nodes[index] = (0, np.inf, index, index, node["leaf_value"])
                    return index
                if node["decision_type"] != "<=" or node["missing_type"] not in ("None", "NaN"):
                    raise ValueError(f"unsupported LightGBM split {node['decision_type']!r} / "
                                     f"{node['missing_type']!r}: numerical '<=' splits only")
                left, right = visit(node["left_child"]), visit(node["right_child"])
                nodes[index] = (node["split_feature"], node["threshold"], left, right, 0.0)
                return index

            visit(info["tree_structure"])
            feature, threshold, left, right, value = (np.array(column) for column in zip(*nodes))
            trees.append((feature, threshold.astype(np.float64), left, right, value, _depth(left, right)))
        return cls._concatenate(trees, "sum")

    @classmethod
    def _concatenate(cls, trees, reduction: str) -> "TreeEnsemble":
        """Per-tree ``(feature, threshold, left, right, value, depth)`` (children as ids within the tree) -> one
        ensemble, deepest tree first."""
        trees = sorted(trees, key=lambda tree: -tree[-1])  # stable: equal depths keep their order
        sizes = np.array([len(tree[0]) for tree in trees])
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        children = np.concatenate([np.stack([tree[2], tree[3]], 1) + offset for tree, offset in zip(trees, offsets)])
        depths = np.array([tree[-1] for tree in trees])
        active = [int((depths > level).sum()) for level in range(int(depths.max(initial=0)))]
        return cls(np.concatenate([tree[0] for tree in trees]),
                   _round_down_float32(np.concatenate([tree[1] for tree in trees])), children.reshape(-1),
                   np.concatenate([tree[4] for tree in trees]), offsets, active, reduction)

    @classmethod
    def empty_like(cls, state: dict, prefix: str) -> "TreeEnsemble":
        """An ensemble with the buffer shapes of a saved state dict (keys ``prefix`` + buffer name) to load it
        into (the reduction and the walk's prefix sizes come with the state's extra state)."""
        nodes = state[prefix + "feature"].numel()
        zeros = np.zeros(nodes)
        return cls(zeros, zeros, np.zeros(2 * nodes), zeros, np.zeros(state[prefix + "roots"].numel()), [], "mean")

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([("mean", "sum").index(self.reduction), *self.active])

    def set_extra_state(self, state: torch.Tensor) -> None:
        reduction, *self.active = state.tolist()
        self.reduction = ("mean", "sum")[reduction]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"x must be (rows, features), got shape {tuple(x.shape)}")
        x = x.float()
        node = self.roots.long().expand(x.shape[0], -1).clone()
        for count in self.active:
            walking = node[:, :count]
            right = x.gather(1, self.feature.take(walking).long()) > self.threshold.take(walking)
            node[:, :count] = self.child.take(2 * walking + right)
        return self.value.take(node)

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prediction, spread over trees) ``(B,)`` each; the spread is 0 for boosting, whose trees add up."""
        leaves = self.forward(x)
        if self.reduction == "sum":
            return leaves.sum(1), torch.zeros_like(leaves[:, 0])
        return leaves.mean(1), leaves.std(1) if leaves.shape[1] > 1 else torch.zeros_like(leaves[:, 0])


def _depth(left: np.ndarray, right: np.ndarray) -> int:
    """Edges on the longest root-to-leaf path of one tree (node 0 the root; a leaf points at itself)."""
    depth, frontier = 0, [0]
    while True:
        frontier = [child for n in frontier for child in (left[n], right[n]) if child != n]
        if not frontier:
            return depth
        depth += 1


def blend_weights(predictions: torch.Tensor, measured: torch.Tensor) -> torch.Tensor:
    """Convex weights ``(M,)`` (non-negative, summing to one) of ``predictions (M, N)`` minimising the squared error
    against ``measured (N,)``: a small quadratic programme (SLSQP)."""
    from scipy.optimize import minimize

    p, y = predictions.double().numpy(), measured.double().numpy()
    m = p.shape[0]
    result = minimize(lambda w: float(np.mean((w @ p - y) ** 2)), np.full(m, 1 / m),
                      jac=lambda w: 2 * p @ (w @ p - y) / y.size, bounds=[(0, 1)] * m,
                      constraints=({"type": "eq", "fun": lambda w: w.sum() - 1},), method="SLSQP")
    weights = np.clip(result.x, 0, None)
    return torch.from_numpy(weights / weights.sum())
