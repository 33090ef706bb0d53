"""bench/peer_speed.py's reading of latq's log (its run needs llm-compressor's environment)."""
from bench import peer_speed


def test_phases_sum_every_block_of_the_log():
    log = "\n".join([
        "INFO block 0/3: Hessians 1.5s, quantization 0.2s, outputs 0.7s",
        "tqdm noise",
        "INFO block 1/3: Hessians 2.0s, quantization 0.3s, outputs 0.5s",
        "INFO block 2/3: Hessians 0.5s, quantization 1.0s, outputs 0.3s",
        "wrote out: 21 layers"])
    assert peer_speed.phases(log) == [4.0, 1.5, 1.5]
    assert peer_speed.phases("no blocks") == [0.0, 0.0, 0.0]
