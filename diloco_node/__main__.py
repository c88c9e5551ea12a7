from diloco_node.cli import main

main()
