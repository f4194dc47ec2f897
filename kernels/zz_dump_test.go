package kernels

import (
	"crypto/sha256"
	"fmt"
	"os"
	"testing"

	"github.com/flashattn/flashattn/attn"
)

func TestZZDumpSources(t *testing.T) {
	f, _ := os.Create(os.Getenv("DUMP"))
	defer f.Close()
	for _, d := range [][2]int{{64, 64}, {128, 128}, {208, 208}, {256, 256}, {320, 320}, {512, 512}} {
		for fi, ft := range fwdFeatures {
			for mode := 0; mode < 5; mode++ {
				v := hopperVariant(t, attn.BFloat16, d[0], d[1], ft.set)
				if v.Varlen && mode > 0 {
					continue
				}
				switch mode {
				case 1:
					v.TMA = true
				case 2:
					v.TMA, v.WarpSpecialized = true, true
				case 3:
					v.TMA, v.WarpSpecialized, v.PingPong = true, true, true
				case 4:
					v.TMA, v.WarpSpecialized, v.PingPong, v.Persistent = true, true, true, true
				}
				src, err := v.Source()
				if err != nil {
					fmt.Fprintf(f, "%v %d %d err\n", d, fi, mode)
					continue
				}
				fmt.Fprintf(f, "%v %d %d %x\n", d, fi, mode, sha256.Sum256([]byte(src)))
			}
		}
	}
	for _, v := range append(bwdHopperVariants(), bwdHopperTMAVariants()...) {
		src, err := v.Source()
		if err != nil {
			fmt.Fprintf(f, "%s err\n", v.Name())
			continue
		}
		fmt.Fprintf(f, "%s %x\n", v.Name(), sha256.Sum256([]byte(src)))
	}
}
