import pytest

from eldr.proxy.metrics import Registry, parse_samples


def test_counter_and_gauge_render_exactly():
    reg = Registry()
    c = reg.counter("x_total", "Things.", ("policy",))
    c.inc(policy="eldr")
    c.inc(2, policy="eldr")
    c.inc(policy='a"b')
    reg.gauge("g", "Live.", ("k",), collect=lambda: {("w0",): 1.5})
    assert reg.render() == (
        "# HELP x_total Things.\n# TYPE x_total counter\n"
        'x_total{policy="a\\"b"} 1\nx_total{policy="eldr"} 3\n'
        "# HELP g Live.\n# TYPE g gauge\n"
        'g{k="w0"} 1.5\n')
    assert c.get(policy="eldr") == 3


def test_histogram_buckets_are_cumulative_and_inclusive():
    reg = Registry()
    h = reg.histogram("lat", "Latency.", buckets=(1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    lines = reg.render().splitlines()[2:]
    assert lines == ['lat_bucket{le="1"} 2', 'lat_bucket{le="2"} 3', 'lat_bucket{le="+Inf"} 4',
                     "lat_sum 6", "lat_count 4"]
    assert h.count() == 4


def test_registry_refuses_duplicates_and_bad_use():
    reg = Registry()
    c = reg.counter("a", "A.", ("x",))
    with pytest.raises(ValueError, match="already registered"):
        reg.counter("a", "A.")
    with pytest.raises(ValueError, match="labels"):
        c.inc(y="1")
    with pytest.raises(ValueError, match="cannot decrease"):
        c.inc(-1, x="1")
    with pytest.raises(ValueError, match="buckets"):
        reg.histogram("h", "H.", buckets=(2.0, 1.0))


def test_parse_samples_sums_label_sets():
    text = ("# HELP vllm:num_requests_running x\n"
            'vllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 2.0\n'
            "vllm:num_requests_waiting 4\n"
            "vllm:num_requests_waiting_other 100\n"
            "vllm:num_requests_swapped NaN\n")
    got = parse_samples(text, ("vllm:num_requests_running", "vllm:num_requests_waiting",
                               "vllm:num_requests_swapped"))
    assert got == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 4.0}
