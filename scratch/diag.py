import sys, time, os, shutil, threading
import numpy as np
from pathlib import Path
from tiercache.files import FileTier, IOPath
import tiercache.files.blockbatch as bb
import tiercache.files.batchio as bio
from tiercache.settings import FileSettings
from tiercache.geometry import PoolSpec
from tiercache.memory import alloc_host
acc={"chunk":0.0,"native":0.0}
lock=threading.Lock()
orun=bio.NativeIO.run
def run(self,*a):
    t=time.thread_time(); r=orun(self,*a)
    with lock: acc["native"]+=time.thread_time()-t
    return r
bio.NativeIO.run=run
for name in ("_write_chunk","_read_chunk"):
    o=getattr(bb.BlockBatches,name)
    def mk(o):
        def f(self,*a):
            t=time.thread_time(); r=o(self,*a)
            with lock: acc["chunk"]+=time.thread_time()-t
            return r
        return f
    setattr(bb.BlockBatches,name,mk(o))
ndev=int(sys.argv[1])
for bs, n in ((16384, 32768), (262144, 8192)):
  for threads in (4, 16):
    roots=[Path(f'/mnt/tcarray/d{i}/diag') for i in range(ndev)]
    for r in roots: shutil.rmtree(r, ignore_errors=True)
    pool=PoolSpec("b",(bs,),"uint8")
    fs=FileSettings(root=roots[0], roots=tuple(roots), fsync="none", verify_checksums=True, io_threads=threads)
    ft=FileTier((pool,), 4*n, IOPath("posix","t"), fs)
    buf,_=alloc_host(n*bs); rows=buf.reshape(n,bs); rows[:]=7
    def go(kind, off):
        for k in acc: acc[k]=0.0
        t=time.perf_counter(); c=os.times()
        futs=[ft.submit(kind, [(off+k,{"b":rows[k]}) for k in range(i,i+256)]) for i in range(0,n,256)]
        for f in futs:
            for k,fu in f: fu.result()
        w=time.perf_counter()-t; c2=os.times()
        print(f"{bs>>10}K threads {threads} {kind}: {n/w:.0f} blocks/s {n*bs/w/1e9:.2f} GB/s; per block: python {(acc['chunk']-acc['native'])/n*1e6:.1f} us, native cpu {acc['native']/n*1e6:.1f} us; process user {(c2.user-c.user)/n*1e6:.1f} sys {(c2.system-c.system)/n*1e6:.1f} us; cores busy {((c2.user-c.user)+(c2.system-c.system))/w:.2f}", flush=True)
    go("write",0); go("write",n); go("read",0)
    ft.close()
    for r in roots: shutil.rmtree(r, ignore_errors=True)
