"""Planning clusters with one thread for scikit-learn's pools, and gives them back afterwards."""

from threadpoolctl import threadpool_info

from moe_proxy.architectures import detect
from moe_proxy.pruning.expert_plan import plan_experts
from moe_proxy.options import PruningOptions
from moe_proxy.checkpoint.layout import find_layout
from moe_proxy.checkpoint.reader import open_checkpoint
from moe_proxy.demo.tiny import make_tiny


def test_planning_clusters_on_one_thread_and_restores_the_pools(tmp_path, monkeypatch):
    from sklearn.cluster import KMeans

    make_tiny("deepseek_v3", tmp_path / "m", num_hidden_layers=3, n_routed_experts=16, n_group=4, topk_group=2)
    ckpt = open_checkpoint(str(tmp_path / "m"))
    layout = find_layout(ckpt, detect(ckpt.config))
    seen, real = [], KMeans.fit_predict

    def fit_predict(self, *args, **kwargs):
        seen.append({p["internal_api"]: p["num_threads"] for p in threadpool_info()})
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KMeans, "fit_predict", fit_predict)
    before = [p["num_threads"] for p in threadpool_info()]
    plan = plan_experts(ckpt, layout, PruningOptions(experts=8))
    assert seen and all(n == 1 for pools in seen for n in pools.values())  # every clustering ran single-threaded
    assert [p["num_threads"] for p in threadpool_info()] == before  # and the pools got their threads back
    assert all(len(s.kept) == 8 for s in plan.selections.values())
