package gpu

import (
	"fmt"
	"github.com/flashattn/flashattn/attn"
	"os"
	"testing"
)

func TestZZDumpDefault(t *testing.T) {
	c := bwdCase{b: 4, n: 4096, m: 4096, h: 16, hkv: 16, dk: 128, dv: 128}
	pl, _ := hopperPlan(t, "d128", c, 1, DQAuto, func(r *bwdRequest) {
		r.ws, r.keyRowsAuto, r.lightTail, r.deep, r.sms = true, true, true, true, 132
	})
	src, err := pl.v.Source()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s algo %v", pl.v.Name(), pl.algo)
	for _, l := range pl.launches {
		t.Logf("launch %s grid %v", l.kernel, l.grid)
	}
	os.WriteFile("/tmp/bwd128.cu", []byte(src), 0o644)
}

func TestZZDumpFwd(t *testing.T) {
	for _, d := range []int{128, 64} {
		c := fwdRecordCase{name: "x", dt: attn.BFloat16, b: 4, n: 4096, m: 4096, h: 16, hkv: 16, dk: d, dv: d, wgmma: true, tma: true}
		p, ts, _, dopt := c.tensors(t)
		b := &Backend{WGMMA: true, TMA: true, Pipeline: DefaultPipeline}
		call := &fwdCall{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], opt: dopt}
		pl, err := b.planForward(call, nil, false)
		if err != nil {
			t.Fatal(err)
		}
		src, err := pl.launch.v.Source()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s", pl.launch.v.Name())
		os.WriteFile(fmt.Sprintf("/tmp/fwd%d.cu", d), []byte(src), 0o644)
	}
}

func TestZZDumpFwdX(t *testing.T) {
	for name, opt := range map[string]attn.Options{"drop": {Dropout: 0.1}, "cap": {Softcap: 30}} {
		c := fwdRecordCase{name: "x", dt: attn.BFloat16, b: 4, n: 4096, m: 4096, h: 16, hkv: 16, dk: 128, dv: 128, wgmma: true, tma: true, opt: opt}
		p, ts, _, dopt := c.tensors(t)
		b := &Backend{WGMMA: true, TMA: true, Pipeline: DefaultPipeline, EarlyDropoutAuto: true}
		call := &fwdCall{p: p, dt: c.dt, q: ts[0], k: ts[1], v: ts[2], o: ts[3], lse: ts[4], opt: dopt}
		pl, err := b.planForward(call, nil, false)
		if err != nil {
			t.Fatal(err)
		}
		src, err := pl.launch.v.Source()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s", pl.launch.v.Name())
		os.WriteFile("/tmp/fwd"+name+".cu", []byte(src), 0o644)
	}
}
