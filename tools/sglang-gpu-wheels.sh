#!/bin/bash
# Download (here, with network) the wheels that SGLang 0.5.10.post1's storage code imports on a
# machine whose Python lacks them (an offline GPU test machine: Python 3.12, torch 2.11, none of
# SGLang's dependencies) into .sglgpu/wheels (ignored by git). With SGLang's files
# (tools/sglang-sources.sh 0.5.10.post1 .sglang-0.5.10) and tests/stubs, this is what
# `tiercache bench sglang-storage` needs there, with CUDA hidden from its process
# (CUDA_VISIBLE_DEVICES=: with CUDA, 0.5.10's pool module imports GPU kernel packages):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/sgsite .sglgpu/wheels/*.whl
#   PYTHONPATH=/tmp/sgsite:$PWD/.sglang-0.5.10:$PWD/tests/stubs CUDA_VISIBLE_DEVICES= tiercache bench sglang-storage ...
# The list: the packages outside that machine's image which the bench's imports reached on a CPU
# machine (docs/sglang.md, "Pages in place, and the GPU machine's array").
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .sglgpu/wheels
plat=()
for p in manylinux_2_5 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux2014 manylinux1; do
  plat+=(--platform "${p}_x86_64")
done
for w in pydantic==2.13.4 pydantic_core==2.46.4 typing-inspection==0.4.2 annotated-types==0.7.0 pybase64==1.5.1 \
         ipython==8.12.3 traitlets==5.15.0 stack-data==0.6.3 executing==2.2.1 asttokens==3.0.1 pure_eval==0.2.3 \
         pexpect==4.8.0 ptyprocess==0.7.0 pickleshare==0.7.5 backcall==0.2.0 decorator==5.2.1 \
         prompt_toolkit==3.0.52 wcwidth==0.7.0 orjson==3.13.0 starlette==1.10.0 httpx2==2.16.2 httpcore2==2.16.2 \
         truststore==0.10.5 pyzmq==27.3.0 openai==3.54.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7 \
         dill==0.4.1 compressed-tensors==0.20.0 loguru==0.7.3 gguf==0.19.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .sglgpu/wheels "$w"
done
du -sh .sglgpu
