import time, torch, sys
from specdec.models.quant_linear import W8A8Linear
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv)>1 else 1)
shapes=[(1536,8960),(8960,1536),(1536,2048),(1536,151936)]
layers={}
for i,o in shapes:
    w=torch.randint(-127,128,(o,i),dtype=torch.int8); sc=torch.rand(o)*0.01+0.001
    l=W8A8Linear(w,sc,None,torch.bfloat16); l.prepack(); layers[(i,o)]=l
res={}
for rep in range(5):
  for (i,o),l in layers.items():
    for M in (1,2,3,4):
        x=torch.randn(M,i).to(torch.bfloat16)
        l.forward_rows(x)
        n=20 if o<100000 else 3
        t=time.perf_counter()
        for _ in range(n): l.forward_rows(x)
        dt=(time.perf_counter()-t)/n
        res.setdefault((i,o,M),[]).append(dt)
for k,v in res.items(): print(k, f"{sorted(v)[2]*1e3:.3f} ms")
# exactness: row 0 alone vs padded
for (i,o),l in layers.items():
    x=torch.randn(1,i).to(torch.bfloat16)
    a=l.forward_rows(x); b=l.forward_rows(torch.cat([x,x]))[:1]
    print((i,o),"pad-equal",torch.equal(a,b))
