"""The loop's table (failure signature -> candidates): every signature has one, every entry is in
the catalogue, and a threshold signature gets the general cures."""

from moe_proxy.investigate.catalogue import CATALOGUE, FOR_SIGNATURE, FOR_THRESHOLD, suggested
from moe_proxy.metrics.detect import SIGNATURES


def test_every_signature_has_candidates_from_the_catalogue_each_with_why():
    assert set(FOR_SIGNATURE) == set(SIGNATURES)
    for signature in SIGNATURES:
        names = [s.name for s in suggested(signature)]
        assert names and len(set(names)) == len(names), signature
        assert all(n in CATALOGUE for n in names), signature
        assert all(s.why for s in suggested(signature))


def test_a_threshold_signature_gets_the_general_cures():
    assert suggested("actor/grad_norm>100:3") == FOR_THRESHOLD
    assert suggested("overflow")[0].name == "loss-scaling"
