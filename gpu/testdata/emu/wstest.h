// The primitives of the warp-specialization tests' kernels (ws_emu_test.go):
// bf16 elements, the shared emulation, the Hopper primitives, mbarriers and
// tensor copies, and ws.h.
constexpr bool emu_bf16 = true;
#include "prims.h"
#include "hopper.h"
#include "tma.h"
#include "ws.h"
inline u32 smem_u32(const void* p) { return emu_smem_addr(p); }
