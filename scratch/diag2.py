import sys, time, os, shutil
import numpy as np
from pathlib import Path
from tiercache import RowStore
import tiercache.files.blockbatch as bb
from tiercache.files import FileTier, IOPath
from tiercache.settings import FileSettings
from tiercache.geometry import PoolSpec
from tiercache.memory import alloc_host
ndev=int(sys.argv[1])
orig=bb.BlockBatches.__dict__["chunks"]
def whole(items):
    out=[]; cur=[]
    for i,_ in enumerate(items):
        cur.append(i)
        if len(cur)==64: out.append(cur); cur=[]
    if cur: out.append(cur)
    return out
def ft_run(bs, n, per, policy, threads=16):
    bb.BlockBatches.chunks=staticmethod(whole) if policy=="whole" else orig
    roots=[Path(f'/mnt/tcarray/d{i}/diag') for i in range(ndev)]
    for r in roots: shutil.rmtree(r, ignore_errors=True)
    pool=PoolSpec("b",(bs,),"uint8")
    fs=FileSettings(root=roots[0], roots=tuple(roots), fsync="none", verify_checksums=True, io_threads=threads)
    ft=FileTier((pool,), 4*n, IOPath("posix","t"), fs)
    buf,_=alloc_host(n*bs); rows=buf.reshape(n,bs); rows[:]=7
    res=[]
    for kind, off in (("write",0),("write",n),("read",0)):
        t=time.perf_counter()
        futs=[ft.submit(kind, [(off+k,{"b":rows[k]}) for k in range(i,min(n,i+per))]) for i in range(0,n,per)]
        for f in futs:
            for k,fu in f: fu.result()
        res.append(n*bs/(time.perf_counter()-t)/1e9)
    ft.close()
    for r in roots: shutil.rmtree(r, ignore_errors=True)
    print(f"FileTier {bs>>10}K requests of {per}, chunks {policy}: write {res[1]:.2f} read {res[2]:.2f} GB/s", flush=True)
def rs_run(bs, n, per, threads=16):
    bb.BlockBatches.chunks=orig
    roots=[Path(f'/mnt/tcarray/d{i}/diagrs') for i in range(ndev)]
    for r in roots: shutil.rmtree(r, ignore_errors=True)
    buf,_=alloc_host(n*bs, pinned=False); rows=buf.reshape(n,bs); rows[:]=5
    keys=[os.urandom(16) for _ in range(n)]
    out=[]
    with RowStore(rows, roots, capacity_blocks=RowStore.blocks_for(n+per), fsync="none", io_threads=threads) as st:
        for op in ("store","load"):
            t=time.perf_counter()
            for i in range(0,n,per):
                idx=list(range(i,min(n,i+per))); (st.submit_store if op=="store" else st.submit_load)([keys[j] for j in idx], idx)
            st.drain(600); assert all(r.success for r in st.finished())
            out.append(n*bs/(time.perf_counter()-t)/1e9)
    for r in roots: shutil.rmtree(r, ignore_errors=True)
    print(f"RowStore {bs>>10}K jobs of {per}: store {out[0]:.2f} load {out[1]:.2f} GB/s", flush=True)
bs, n = 262144, 8192
for per in (8, 32):
    for pol in ("now", "whole"):
        ft_run(bs, n, per, pol)
for per in (32, 256):
    rs_run(bs, n, per)
