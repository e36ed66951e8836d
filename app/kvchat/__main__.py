from kvchat.cli import main

main()
