package cuda

import (
	"bytes"
	"encoding/binary"
	"testing"
)

func TestParamBuffer(t *testing.T) {
	tests := []struct {
		name  string
		build func(p *ParamBuffer)
		want  []byte
	}{
		{
			name: "ptr ptr int", // struct { float* a; float* b; int n; }: 20 bytes padded to 24
			build: func(p *ParamBuffer) {
				p.Ptr(0x1122334455667788)
				p.Ptr(1)
				p.I32(-2)
			},
			want: []byte{0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 1, 0, 0, 0, 0, 0, 0, 0,
				0xfe, 0xff, 0xff, 0xff, 0, 0, 0, 0},
		},
		{
			name: "int then ptr", // the pointer aligns to 8
			build: func(p *ParamBuffer) {
				p.U32(7)
				p.Ptr(9)
			},
			want: []byte{7, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			name: "byte half float",
			build: func(p *ParamBuffer) {
				p.U8(1)
				p.U16(0x3c00)
				p.F32(1)
			},
			want: []byte{1, 0, 0x00, 0x3c, 0, 0, 0x80, 0x3f},
		},
		{
			name:  "float only",
			build: func(p *ParamBuffer) { p.F32(-0.5) },
			want:  []byte{0, 0, 0, 0xbf},
		},
		{
			name: "aligned 16",
			build: func(p *ParamBuffer) {
				p.F64(1)
				p.Align(16)
				p.I64(-1)
			},
			// 8 bytes, padding to 16, 8 bytes, tail padding to 32.
			want: append(append([]byte{0, 0, 0, 0, 0, 0, 0xf0, 0x3f, 0, 0, 0, 0, 0, 0, 0, 0},
				0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff), make([]byte, 8)...),
		},
		{
			name:  "empty",
			build: func(p *ParamBuffer) {},
			want:  []byte{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var p ParamBuffer
			tt.build(&p)
			if got := p.Bytes(); !bytes.Equal(got, tt.want) {
				t.Errorf("Bytes() = % x, want % x", got, tt.want)
			}
			p.Reset()
			if p.Len() != 0 || len(p.Bytes()) != 0 {
				t.Error("Reset left bytes")
			}
		})
	}
}

func TestAsBytes(t *testing.T) {
	if got := AsBytes([]float32{1, -2}); !bytes.Equal(got, []byte{0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0}) {
		t.Errorf("AsBytes = % x", got)
	}
	if AsBytes([]uint64(nil)) != nil {
		t.Error("AsBytes(nil) != nil")
	}
}

// TestEarlyLaunchConfig checks the bytes LaunchEarly hands cuLaunchKernelEx
// against cuda.h's layouts: CUlaunchConfig (seven 32-bit dims and sizes,
// the stream at 32, the attribute array at 40, its count at 48: 56 bytes)
// and one CUlaunchAttribute (the id, padding to 8, a 64-byte value union
// whose first int is programmaticStreamSerializationAllowed).
func TestEarlyLaunchConfig(t *testing.T) {
	cfg := make([]byte, launchConfigBytes+launchAttrBytes)
	for i := range cfg {
		cfg[i] = 0xee // everything not written below must come out zero
	}
	putEarlyLaunchConfig(cfg, [3]uint32{7, 8, 9}, [3]uint32{256, 1, 2}, 4096, 0x1234, 0xabcdef)
	le := binary.LittleEndian
	want := map[int]uint64{0: 7, 4: 8, 8: 9, 12: 256, 16: 1, 20: 2, 24: 4096}
	for off, v := range want {
		if got := le.Uint32(cfg[off:]); uint64(got) != v {
			t.Errorf("config word at %d = %d, want %d", off, got, v)
		}
	}
	if got := le.Uint32(cfg[28:]); got != 0 {
		t.Errorf("padding after sharedMemBytes = %#x", got)
	}
	if got := le.Uint64(cfg[32:]); got != 0x1234 {
		t.Errorf("hStream = %#x", got)
	}
	if got := le.Uint64(cfg[40:]); got != 0xabcdef {
		t.Errorf("attrs = %#x", got)
	}
	if got := le.Uint32(cfg[48:]); got != 1 {
		t.Errorf("numAttrs = %d", got)
	}
	attr := cfg[launchConfigBytes:]
	if got := le.Uint32(attr[0:]); got != launchAttrProgrammaticSerialization || launchAttrProgrammaticSerialization != 6 {
		t.Errorf("attribute id = %d, want CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6)", got)
	}
	if got := le.Uint32(attr[8:]); got != 1 {
		t.Errorf("programmaticStreamSerializationAllowed = %d", got)
	}
	for i, b := range cfg {
		if (i >= 52 && i < launchConfigBytes) || (i >= launchConfigBytes+4 && i < launchConfigBytes+8) || i >= launchConfigBytes+12 {
			if b != 0 {
				t.Fatalf("byte %d = %#x, want 0 (padding or the rest of the value union)", i, b)
			}
		}
	}
}
