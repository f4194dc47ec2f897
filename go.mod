module github.com/flashattn/flashattn

go 1.26.8
