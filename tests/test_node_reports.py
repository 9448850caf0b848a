"""What a node sends the coordinator never dies of its content: a stage whose loss went NaN (poisoned
weights, say) once ended the node's metrics reporter, and its final report then failed the stage,
blaming the honest node for it."""
import json

from node.daemon import BackgroundSender, reportable
from ravnest.spec import MetricsReport


def test_non_finite_figures_are_left_out_of_a_report():
    figures = reportable({"loss": float("nan"), "step": 3.0, "accuracy": float("inf"), "lr": 0.1})
    assert figures == {"step": 3.0, "lr": 0.1}
    report = MetricsReport(node_id="n", cluster=0, stage=0, step=3, metrics=figures)
    json.dumps(report.model_dump(), allow_nan=False)  # what httpx does with a body: it would raise on NaN


def test_the_sender_sends_on_after_an_item_it_could_not_send():
    sent = []

    def send(item: str) -> None:
        if item == "poison":
            raise ValueError("Out of range float values are not JSON compliant")
        sent.append(item)
    sender = BackgroundSender(send, capacity=8, name="test-sender")
    for item in ("a", "poison", "b"):
        sender.put(item)
    sender.close()
    assert sent == ["a", "b"]
