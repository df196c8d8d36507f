# call 181 (1xH200): the Python drop-in with the copy-engine path (MOELINK_HT_CE_PIECES=4), two processes sharing
# the GPU under MPS: the python step's hostcost sub-step (host-cost bench, the GPU suite at 2 ranks, DeepEP's
# test_low_latency / test_intranode against moelink, then against DeepEP V1).
export MOELINK_COMMIT=528ea94 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
CE=${CE:-4}
[ "$CE" = 0 ] || export MOELINK_HT_CE_PIECES=$CE
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=540 BUDGET_S=560 \
  OUT=/tmp/o181 W=/tmp/w181 bash scripts/device/run.sh > /tmp/python181.log 2>&1
echo "python rc=$?"
cp /tmp/python181.log /tmp/w181/python/ 2>/dev/null
tar -C /tmp/w181 -czf $OUT/call181-ce$CE.tgz python
grep -hE "\[tuning\] Best|passed|Error|rc=" /tmp/w181/python/deepep-tests.log /tmp/w181/python/deepep-baseline.log 2>/dev/null | head -30
tail -40 /tmp/python181.log
