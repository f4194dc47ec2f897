package vec

//go:generate sh -c "cd asm && go run . -out ../kernels_amd64.s -stubs ../kernels_amd64.go -pkg vec -panels ../panels_amd64.go"
