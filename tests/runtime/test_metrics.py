import urllib.request

from diloco.runtime.ops.metrics import WorkerMetrics


def test_metrics_are_served_with_labels_and_wire_counters_are_monotonic():
    m = WorkerMetrics(group=1, rank=0)
    port = m.serve(0, host="127.0.0.1")
    try:
        m.inner_steps.inc(5)
        m.wire_totals(1000, 400)
        m.wire_totals(1500, 900)
        m.loss.set(2.5)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    assert 'diloco_inner_steps_total{group="1",rank="0"} 5.0' in body
    assert 'diloco_wire_sent_bytes_total{group="1",rank="0"} 1500.0' in body
    assert 'diloco_wire_received_bytes_total{group="1",rank="0"} 900.0' in body
    assert 'diloco_train_loss{group="1",rank="0"} 2.5' in body
