# Issue 29 attribution on CPU: which modules lose multilingual/code quality when the GPTQ
# pass sees only the shared English text (A = shared, B = the shipped mix; same allocation).
set -u
cd /work/main
A=/tmp/d29/s23/floor-0; B=/tmp/d29/t2-sharedalloc-mixgptq; O=/tmp/d29/s24
mkdir -p $O
for s in head layers:0-9 layers:10-19 layers:20-29 attn mlp; do
  n=$(echo $s | tr ':' '-')
  .venv/bin/python .devdata/s24/splice.py $A $B $O/$n $s >> $O/splice.log 2>&1
done
.venv/bin/python tools/perplexity.py -m $O/head $O/layers-0-9 $O/layers-10-19 $O/layers-20-29 $O/attn $O/mlp --domains --windows 8 --device cpu > $O/ppl.log 2>&1
echo "done rc=$?" >> $O/splice.log
