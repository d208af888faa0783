"""Run from the repo root without TRITON_INTERPRET: python benchmarks/gpu/compile_policy_kernels.py

Compile every policy/kl kernel specialisation for sm_90 without a GPU (catches JIT errors the interpreter cannot)."""
import itertools, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import csrc_triton.kl as K
import csrc_triton.policy_loss as P

T90 = GPUTarget("cuda", 90, 32)
n_ok = 0
def comp(fn, sig, consts):
    global n_ok
    try:
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=T90)
        n_ok += 1
    except Exception as e:
        print("FAIL", fn.__name__, consts, str(e)[:1500]); sys.exit(1)

for est, cl in itertools.product(range(3), (False, True)):
    comp(K._kl_fwd_kernel, {"logp_ptr": "*bf16", "ref_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "clamp": "fp32"},
         {"EST": est, "HAS_CLAMP": cl, "BLOCK": 1024})
    comp(K._kl_bwd_kernel, {"logp_ptr": "*bf16", "ref_ptr": "*fp32", "gout_ptr": "*fp32", "glogp_ptr": "*bf16", "gref_ptr": "*fp32", "n": "i32", "clamp": "fp32"},
         {"EST": est, "HAS_CLAMP": cl, "WRITE_LOGP": True, "WRITE_REF": cl, "BLOCK": 1024})

for sr, si, cl in itertools.product((False, True), repeat=3):
    comp(P._row_pre_kernel, dict(logp_ptr="*bf16", old_ptr="*fp32", mask_ptr="*u8", roll_ptr="*fp32", pre_ptr="*fp32",
         T="i32", NC="i32", s_logp="i32", s_old="i32", s_mask="i32", s_roll="i32", lr_clamp="fp32"),
         dict(SEQ_RATIO=sr, SEQ_IS=si, HAS_LR_CLAMP=cl, BLOCK=1024))

fwd_sig = dict(logp_ptr="*bf16", old_ptr="*fp32", adv_ptr="*fp32", mask_ptr="*u8", ref_ptr="*bf16", ent_ptr="*fp32",
               roll_ptr="*fp32", pre_ptr="*fp32", grad_ptr="*fp32", part_ptr="*fp32", T="i32", NC="i32",
               s_logp="i32", s_old="i32", s_adv_row="i32", s_adv_col="i32", s_mask="i32", s_ref="i32", s_ent="i32",
               s_roll="i32", s_grad="i32", ratio_lo="fp32", ratio_hi="fp32", dual_clip="fp32", lr_clamp="fp32",
               kl_coef="fp32", kl_clamp="fp32", is_cap="fp32")
combos = [
    dict(SEQ_RATIO=False, SEQ_IS=False, HAS_DUAL=False, HAS_LR_CLAMP=False, HAS_REF=False, KL_EST=2, HAS_KL_CLAMP=False, HAS_ENT=False, HAS_IS=False, HAS_IS_CAP=False, KL_GRAD=False, WRITE_GRAD=True),
    dict(SEQ_RATIO=False, SEQ_IS=False, HAS_DUAL=True, HAS_LR_CLAMP=True, HAS_REF=True, KL_EST=0, HAS_KL_CLAMP=True, HAS_ENT=True, HAS_IS=True, HAS_IS_CAP=True, KL_GRAD=True, WRITE_GRAD=True),
    dict(SEQ_RATIO=False, SEQ_IS=True, HAS_DUAL=False, HAS_LR_CLAMP=False, HAS_REF=True, KL_EST=1, HAS_KL_CLAMP=False, HAS_ENT=False, HAS_IS=True, HAS_IS_CAP=False, KL_GRAD=True, WRITE_GRAD=False),
    dict(SEQ_RATIO=True, SEQ_IS=False, HAS_DUAL=True, HAS_LR_CLAMP=True, HAS_REF=True, KL_EST=2, HAS_KL_CLAMP=True, HAS_ENT=True, HAS_IS=False, HAS_IS_CAP=False, KL_GRAD=True, WRITE_GRAD=True),
    dict(SEQ_RATIO=True, SEQ_IS=True, HAS_DUAL=False, HAS_LR_CLAMP=False, HAS_REF=False, KL_EST=2, HAS_KL_CLAMP=False, HAS_ENT=False, HAS_IS=True, HAS_IS_CAP=True, KL_GRAD=False, WRITE_GRAD=False),
]
for c in combos:
    comp(P._policy_fwd_kernel, fwd_sig, dict(c, NC_P2=4, BLOCK=1024))
fin_sig = dict(part_ptr="*fp32", out_ptr="*fp32", rowcoef_ptr="*fp32", gcount_ptr="*i64", B="i32", NC="i32",
               gcount_val="fp32", norm_length="fp32", kl_coef="fp32", entropy_coef="fp32")
for agg, gp, gv, uk, ue in [(0, False, False, True, True), (1, True, False, False, True), (2, False, True, True, False), (3, False, False, False, False)]:
    comp(P._policy_finalize_kernel, fin_sig, dict(AGG=agg, HAS_GPTR=gp, HAS_GVAL=gv, USE_KL=uk, USE_ENT=ue, BLOCK_B=32, NC_P2=8))
bwd_sig = dict(gout_ptr="*fp32", out_ptr="*fp32", rowcoef_ptr="*fp32", g_ptr="*fp32", mask_ptr="*fp32", logp_ptr="*bf16",
               old_ptr="*fp32", glogp_ptr="*bf16", gent_ptr="*fp16", T="i32", s_g="i32", s_mask="i32", s_logp="i32",
               s_old="i32", s_glogp="i32", s_gent="i32", lr_clamp="fp32", entropy_coef="fp32")
for hg, sr, cl, wl, we in [(True, False, False, True, True), (False, True, True, True, False), (True, True, False, True, True), (False, False, False, False, True)]:
    comp(P._policy_bwd_kernel, bwd_sig, dict(HAS_G=hg, SEQ_RATIO=sr, HAS_LR_CLAMP=cl, WRITE_LOGP=wl, WRITE_ENT=we, BLOCK=1024))
print("compiled", n_ok, "specialisations for sm_90")
