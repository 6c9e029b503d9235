#!/usr/bin/env python3
# The caching allocator's reuse rule (core/cuda/device.cpp allocate: best fit among cached blocks, a block
# up to twice the rounded request, never split) walked through the Qwen3.6-27B target's random FP8 load:
# assemble_weights (every bf16 tensor), apply_precision (each projection's codes + scales, its bf16 copy
# freed), the end-of-load empty_cache, then CudaTargetModel's fused copies (q|k|v, qkv|z, b|a, gate|up).
# Session 29's question: why the 27B FP8 recipe held 64.9 GiB after loading where the memory plan's target
# weights + drafter state say 56.5. Prints the live bytes after the target under the old rule (the cache
# emptied once, at the end: 35.85 GiB, 8.40 above the plan's 27.45) and with 1fa7c68's per-projection
# empty_cache (28.04). Shapes from configs/qwen3.6-27b/config.json; norms and small tensors approximate.
#   python3 bench/probes/alloc_walk.py
import bisect
H,I,L,V=5120,17408,64,248320
Hq,Hkv,d=24,4,256
Hk,Hv,dk,dv=16,48,128,128
C=2*Hk*dk+Hv*dv; VV=Hv*dv
def rb(b):
    if b<1<<20: return (b+511)//512*512
    return (b+(2<<20)-1)//(2<<20)*(2<<20)
class A:
    def __init__(s): s.free=[]; s.live={}; s.alloc=0; s.res=0; s.n=0
    def malloc(s,b):
        r=rb(b); i=bisect.bisect_left(s.free,(r,-1))
        if i<len(s.free) and s.free[i][0]<=2*r:
            sz,_=s.free.pop(i); s.n+=1; s.live[s.n]=sz; s.alloc+=sz; return s.n
        s.n+=1; s.live[s.n]=r; s.alloc+=r; s.res+=r; return s.n
    def release(s,h):
        sz=s.live.pop(h); s.alloc-=sz; bisect.insort(s.free,(sz,h))
    def empty(s):
        for sz,_ in s.free: s.res-=sz
        s.free=[]
def run(per_proj_empty):
    a=A(); W={}
    W['embed']=a.malloc(V*H*2)
    types=['attn' if (i+1)%4==0 else 'gdn' for i in range(L)]
    shapes={}
    for i,t in enumerate(types):
        W[(i,'ln')]=a.malloc(H*2)
        if t=='gdn':
            for n,(r,k) in [('qkv',(C,H)),('z',(VV,H)),('b',(Hv,H)),('a',(Hv,H)),('conv',(C,4)),('out',(H,VV))]:
                W[(i,n)]=a.malloc(r*k*2); shapes[(i,n)]=(r,k)
        else:
            for n,(r,k) in [('q',(2*Hq*d,H)),('k',(Hkv*d,H)),('v',(Hkv*d,H)),('o',(H,Hq*d))]:
                W[(i,n)]=a.malloc(r*k*2); shapes[(i,n)]=(r,k)
        W[(i,'pln')]=a.malloc(H*2)
        for n,(r,k) in [('gate',(I,H)),('up',(I,H)),('down',(H,I))]:
            W[(i,n)]=a.malloc(r*k*2); shapes[(i,n)]=(r,k)
    W['norm']=a.malloc(H*2); W['lm']=a.malloc(V*H*2)
    # apply_precision
    order=[]
    for i,t in enumerate(types):
        order+= [(i,n) for n in (['qkv','z','out'] if t=='gdn' else ['q','k','v','o'])]+[(i,'gate'),(i,'up'),(i,'down')]
    for key in order:
        r,k=shapes[key]
        codes=a.malloc(r*k); sc=a.malloc(((r+127)//128)*((k+127)//128)*4)
        a.release(W[key]); W[key]=codes; W[(key,'s')]=sc
        if per_proj_empty: a.empty()
    a.empty()
    # make_proj: fused groups
    for i,t in enumerate(types):
        groups=[['qkv','z'],['b','a']] if t=='gdn' else [['q','k','v']]
        groups.append(['gate','up'])
        for g in groups:
            fp8 = g[0] not in ('b','a')
            tot=sum(shapes[(i,n)][0]*shapes[(i,n)][1] for n in g)*(1 if fp8 else 2)
            f=a.malloc(tot)
            for n in g: a.release(W[(i,n)])
    a.empty()
    return a.alloc/2**30
print("old rule (empty at the end): %.2f GiB live after the target" % run(False))
print("new (empty after each projection): %.2f GiB" % run(True))
