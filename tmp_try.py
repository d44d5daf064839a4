from moe_proxy.investigate.bisect import search, Probe
class C:
    def __init__(s,i): s.step=i; s.uri=f"u{i}"
for n, bad in [(8,5),(9,5),(8,0),(8,7),(17,9),(64,33),(2,1),(8,99)]:
    for P in (1,2,3):
        rounds=[]
        f, probes = search([C(i) for i in range(n)], lambda i: Probe("u",i,i>=bad,None,None), False, P, rounds=rounds)
        print(n, bad, P, f, rounds)
