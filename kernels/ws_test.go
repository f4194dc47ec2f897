package kernels

import (
	"strings"
	"testing"
)

// TestWarpSpecializedPrimitives checks that each wrapper the emulator
// stands in for by name issues its PTX instruction.
func TestWarpSpecializedPrimitives(t *testing.T) {
	src := WarpSpecializedPrimitives()
	for _, c := range []struct{ decl, ptx string }{
		{"void bar_sync(u32 id, u32 count)", `"bar.sync %0, %1;`},
		{"void bar_arrive(u32 id, u32 count)", `"bar.arrive %0, %1;`},
		{"void barrier_sync(u32 id, u32 count)", `"barrier.sync %0, %1;`},
		{"void barrier_arrive(u32 id, u32 count)", `"barrier.arrive %0, %1;`},
		{"void mbar_arrive(u32 bar)", `"mbarrier.arrive.shared::cta.b64 _, [%0];`},
		{"void setmaxnreg_inc()", `"setmaxnreg.inc.sync.aligned.u32 %0;`},
		{"void setmaxnreg_dec()", `"setmaxnreg.dec.sync.aligned.u32 %0;`},
		{"void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes)", `"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;`},
		{"void bulk_commit()", `"cp.async.bulk.commit_group;`},
		{"void bulk_wait()", `"cp.async.bulk.wait_group %0;`},
		{"void bulk_wait_read()", `"cp.async.bulk.wait_group.read %0;`},
	} {
		i := strings.Index(src, c.decl+" {")
		if i < 0 {
			t.Errorf("no wrapper %q", c.decl)
			continue
		}
		body := strings.SplitN(src[i:], "\nDEV", 2)[0] // up to the next wrapper
		if !strings.Contains(body, c.ptx) {
			t.Errorf("%s: want %s in\n%s", c.decl, c.ptx, body)
		}
	}
}
